//! Concurrency caps, request rates, idempotency, the ledger sequence, whole-run reservations
//! and the global cutoff.

use crate::support::{
    admit, admit_refused, check_ledger, day, finish, heartbeat, held_refusal, line, micros_step,
    model_step, policy, reservation, reservations, reserve, reserve_refused, resolve, seq, summary,
    sweep, tokens, tool_step, units, ur, usage, Who, START, TOOL_PER_CALL,
};
use crate::Backend;
use spendgate_core::{
    Adjustment, IdempotencyKey, IpScope, LedgerError, Micros, Rate, Refusal, RefusalCode,
    Reservation, ReservationKind, ReservationMode, ReservationState, Resolution, RunState,
    ScopeKey, ScopeKind, ScopePolicy, SessionGrant, CUTOFF_MESSAGE, RECORD_RETENTION_MS,
};
use spendgate_store::{Store, StoreError};
use std::sync::Arc;

fn refusal(r: &Refusal, code: RefusalCode, scope: ScopeKind) {
    assert_eq!((r.code, r.scope), (code, Some(scope)), "{r:?}");
}

/// One active run per conversation, and caps per session, per address and globally; a
/// refusal holds no slot; finishing a run frees its slots.
pub async fn concurrency_caps(b: &dyn Backend) {
    let mut p = policy();
    p.global.concurrency = Some(4);
    p.ip.concurrency = Some(3);
    p.session.concurrency = Some(2);
    p.conversation.concurrency = Some(1);
    let s = b.open(p, START).await;
    let (ip_a, ip_b, ip_c) = ("192.0.2.1/32", "192.0.2.2/32", "192.0.2.3/32");
    let limited = |r: &Refusal, scope| {
        refusal(r, RefusalCode::ConcurrencyLimited, scope);
        assert!(r.retry_after_s.is_some_and(|s| s >= 1), "{r:?}");
    };
    admit(&s, Who::new("s1", "c1", ip_a).run("r1")).await;
    let r = admit_refused(&s, Who::new("s1", "c1", ip_a).run("r2")).await;
    limited(&r, ScopeKind::Conversation);
    admit(&s, Who::new("s1", "c2", ip_a).run("r2")).await;
    let r = admit_refused(&s, Who::new("s1", "c3", ip_a).run("r3")).await;
    limited(&r, ScopeKind::Session);
    admit(&s, Who::new("s2", "c3", ip_a).run("r3")).await;
    let r = admit_refused(&s, Who::new("s3", "c4", ip_a).run("r4")).await;
    limited(&r, ScopeKind::Ip);
    admit(&s, Who::new("s3", "c4", ip_b).run("r4")).await;
    let before = seq(&s).await;
    let r = admit_refused(&s, Who::new("s4", "c5", ip_c).run("r5")).await;
    limited(&r, ScopeKind::Global);
    assert_eq!(seq(&s).await, before, "a refusal changes nothing");
    assert_eq!(summary(&s).await.runs_active, 4);

    finish(&s, "r1").await;
    admit(&s, Who::new("s4", "c5", ip_c).run("r5")).await;
    let r = admit_refused(&s, Who::new("s4", "c6", ip_c).run("r6")).await;
    limited(&r, ScopeKind::Global);
    finish(&s, "r2").await;
    admit(&s, Who::new("s1", "c1", ip_a).run("r6")).await;
    assert_eq!(summary(&s).await.runs_active, 4);
}

/// Session creation is limited per address prefix (a wider prefix by its factor) and
/// globally; a dry creation answers the same and applies nothing; pressure (more than half a
/// burst in use) is told for the prefixes of the request and the global bucket only.
pub async fn session_creation_rates(b: &dyn Backend) {
    let mut p = policy();
    p.session_create_per_ip = Some(Rate {
        count: 4,
        period_ms: 3_600_000,
        burst: 4,
    });
    p.session_create_global = Some(Rate {
        count: 10,
        period_ms: 3_600_000,
        burst: 10,
    });
    let s = b.open(p, START).await;
    let ip = |prefix: &str| {
        vec![IpScope {
            prefix: prefix.into(),
            factor: 1,
        }]
    };
    let create = |prefix: &'static str, dry: bool| {
        let s = s.clone();
        async move {
            s.create_session(ip(prefix), dry)
                .await
                .expect("store answers")
        }
    };
    // Dry asks change nothing, however many.
    let before = seq(&s).await;
    for _ in 0..10 {
        let a = create("192.0.2.1/32", true).await;
        assert_eq!(a.value, Ok(SessionGrant { pressure: false }));
        assert!(!a.changed);
    }
    assert_eq!(seq(&s).await, before, "a dry creation applies nothing");

    // Four from one address: the third and fourth are past half its burst.
    let mut pressure = Vec::new();
    for _ in 0..4 {
        let a = create("192.0.2.1/32", false).await;
        assert!(a.changed);
        pressure.push(a.value.expect("granted").pressure);
    }
    assert_eq!(pressure, [false, false, true, true]);
    for dry in [true, false] {
        let r = create("192.0.2.1/32", dry)
            .await
            .value
            .expect_err("limited");
        refusal(&r, RefusalCode::RateLimited, ScopeKind::Ip);
        assert!(r.retry_after_s.is_some_and(|s| s >= 1), "{r:?}");
    }
    // Another address is not under the first one's pressure (global: 4 of 10 used).
    let a = create("192.0.2.2/32", true).await;
    assert_eq!(a.value, Ok(SessionGrant { pressure: false }));
    // A wider prefix with factor 2 has twice the room.
    let wide = vec![IpScope {
        prefix: "2001:db8::/56".into(),
        factor: 2,
    }];
    for _ in 0..5 {
        s.create_session(wide.clone(), false)
            .await
            .expect("store answers")
            .value
            .expect("within 8");
    }
    // Global: 9 of 10 used, so the next creation anywhere is under pressure, the one after
    // that is refused globally.
    let a = create("192.0.2.3/32", false).await;
    assert_eq!(a.value, Ok(SessionGrant { pressure: true }));
    let r = create("192.0.2.4/32", false)
        .await
        .value
        .expect_err("global");
    refusal(&r, RefusalCode::RateLimited, ScopeKind::Global);
}

/// GCRA per session, address and globally, each with its burst; refusals say when to retry
/// and consume nothing.
pub async fn rate_limits_gcra(b: &dyn Backend) {
    let rate = |count, burst| Rate {
        count,
        period_ms: 60_000,
        burst,
    };
    let mut p = policy();
    p.conversation.concurrency = None;
    p.lease_ttl_ms = 120_000;
    p.global.rate = Some(rate(5, 5));
    p.ip.rate = Some(rate(3, 3));
    p.session.rate = Some(rate(2, 2));
    let s = b.open(p, START).await;
    let limited = |r: &Refusal, scope, secs| {
        refusal(r, RefusalCode::RateLimited, scope);
        assert_eq!(r.retry_after_s, Some(secs), "{r:?}");
    };
    let ip_a = "192.0.2.1/32";
    admit(&s, Who::new("s1", "c1", ip_a).run("r1")).await;
    admit(&s, Who::new("s1", "c1", ip_a).run("r2")).await;
    let before = seq(&s).await;
    // Session: 2 per minute, burst 2: the next in 30 s.
    let r = admit_refused(&s, Who::new("s1", "c1", ip_a).run("r3")).await;
    limited(&r, ScopeKind::Session, 30);
    assert_eq!(seq(&s).await, before, "a refusal changes nothing");
    admit(&s, Who::new("s2", "c2", ip_a).run("r4")).await;
    // Ip: 3 per minute: the next in 20 s.
    let r = admit_refused(&s, Who::new("s3", "c3", ip_a).run("r5")).await;
    limited(&r, ScopeKind::Ip, 20);
    admit(&s, Who::new("s3", "c3", "192.0.2.2/32").run("r6")).await;
    admit(&s, Who::new("s4", "c4", "192.0.2.3/32").run("r7")).await;
    // Global: 5 per minute: the next in 12 s.
    let r = admit_refused(&s, Who::new("s5", "c5", "192.0.2.4/32").run("r8")).await;
    limited(&r, ScopeKind::Global, 12);
    // Refusals took nothing: one interval later exactly one more is admitted.
    b.advance(12_000);
    admit(&s, Who::new("s5", "c5", "192.0.2.4/32").run("r9")).await;
    let r = admit_refused(&s, Who::new("s6", "c6", "192.0.2.5/32").run("r10")).await;
    limited(&r, ScopeKind::Global, 12);
    // The session's bucket refills too: at 30 s, s1 is admitted again.
    b.advance(18_000);
    admit(&s, Who::new("s1", "c1", ip_a).run("r11")).await;
    assert_eq!(summary(&s).await.runs_active, 7);
}

fn key(key: &str, fingerprint: &str) -> Option<IdempotencyKey> {
    Some(IdempotencyKey {
        key: key.into(),
        fingerprint: fingerprint.into(),
    })
}

async fn conflict<T: std::fmt::Debug>(r: Result<T, StoreError>) {
    match r {
        Err(StoreError::Ledger(LedgerError::IdempotencyConflict, _)) => {}
        other => panic!("same key, other request: must be a conflict, answered {other:?}"),
    }
}

/// A repeated admission (same key and fingerprint) returns the first answer, a refusal
/// included, and holds nothing twice; the same key with another fingerprint is a conflict.
pub async fn idempotent_admission(b: &dyn Backend) {
    let mut p = policy();
    p.mode = ReservationMode::WholeRun;
    p.run.max_cost = Micros(50_000);
    let s = b.open(p, START).await;
    let w = Who::new("s1", "c1", "192.0.2.1/32");
    let first = s
        .admit_run(w.run("r1"), key("run:k1", "f1"))
        .await
        .expect("store answers");
    let admitted = first.value.clone().expect("admitted");
    assert_eq!(admitted.reserved, Micros(50_000));
    let again = s
        .admit_run(w.run("r1"), key("run:k1", "f1"))
        .await
        .expect("store answers");
    assert_eq!(again.value, first.value, "the first answer");
    assert_eq!(again.seq, first.seq, "a repeat changes nothing");
    assert_eq!(summary(&s).await.runs_active, 1);
    let lines = check_ledger(&s, &w.scopes()).await;
    assert_eq!(ur(&lines, ScopeKind::Global), (0, 50_000), "held once");
    conflict(s.admit_run(w.run("r1"), key("run:k1", "f2")).await).await;

    // A refusal is an answer too.
    let refused = s
        .admit_run(w.run("r2"), key("run:k2", "g"))
        .await
        .expect("store answers");
    let r = refused.value.clone().expect_err("conversation busy");
    refusal(&r, RefusalCode::ConcurrencyLimited, ScopeKind::Conversation);
    finish(&s, "r1").await;
    let again = s
        .admit_run(w.run("r2"), key("run:k2", "g"))
        .await
        .expect("store answers");
    assert_eq!(again.value, refused.value, "the first answer, a refusal");
    assert_eq!(summary(&s).await.runs_active, 0);
    // Without the key the request is decided anew.
    admit(&s, w.run("r2")).await;
    let lines = check_ledger(&s, &w.scopes()).await;
    assert_eq!(ur(&lines, ScopeKind::Global), (0, 50_000));
}

/// A repeated step reservation returns the first answer, a refusal included, and holds
/// nothing twice; the same key with another fingerprint is a conflict.
pub async fn idempotent_step(b: &dyn Backend) {
    let mut p = policy();
    p.run.max_cost = Micros(8_000);
    let s = b.open(p, START).await;
    let w = Who::new("s1", "c1", "192.0.2.1/32");
    admit(&s, w.run("r1")).await;
    let req = micros_step("r1", "a", 5_000);
    let first = s
        .reserve_step(req.clone(), key("step:r1:k1", "f1"))
        .await
        .expect("store answers");
    assert_eq!(first.value.as_ref().map(|g| g.reserved), Ok(Micros(5_000)));
    let again = s
        .reserve_step(req.clone(), key("step:r1:k1", "f1"))
        .await
        .expect("store answers");
    assert_eq!(again.value, first.value);
    assert_eq!(again.seq, first.seq);
    let lines = check_ledger(&s, &w.scopes()).await;
    assert_eq!(ur(&lines, ScopeKind::Global), (0, 5_000), "held once");
    assert_eq!(reservations(&s).await.len(), 1);
    conflict(s.reserve_step(req, key("step:r1:k1", "f2")).await).await;

    let req = micros_step("r1", "b", 5_000);
    let refused = s
        .reserve_step(req.clone(), key("step:r1:k2", "g"))
        .await
        .expect("store answers");
    let r = refused
        .value
        .clone()
        .expect_err("over the run's cost bound");
    // (held by the run's own step a: a wait)
    held_refusal(&r, ScopeKind::Run);
    resolve(&s, "a", Resolution::Release).await;
    let again = s
        .reserve_step(req, key("step:r1:k2", "g"))
        .await
        .expect("store answers");
    assert_eq!(again.value, refused.value, "the first answer, a refusal");
    let g = reserve(&s, micros_step("r1", "c", 5_000)).await;
    assert_eq!(g.reserved, Micros(5_000));
    let lines = check_ledger(&s, &w.scopes()).await;
    assert_eq!(ur(&lines, ScopeKind::Global), (0, 5_000));
}

/// The ledger sequence grows with every change, is what each answer carries, and is left
/// alone by reads, refusals and repeated answers.
pub async fn ledger_seq(b: &dyn Backend) {
    let s = b.open(policy(), START).await;
    let w = Who::new("s1", "c1", "192.0.2.1/32");
    let mut last = seq(&s).await;
    let mut grew = |name: &str, applied_seq: u64, now: u64| {
        assert!(
            applied_seq > last,
            "{name}: seq must grow ({last} -> {applied_seq})"
        );
        assert_eq!(
            applied_seq, now,
            "{name}: the answer carries the ledger's seq"
        );
        last = applied_seq;
    };
    let a = admit(&s, w.run("r1")).await;
    grew("admit", a.seq, seq(&s).await);
    let g = s
        .reserve_step(micros_step("r1", "a", 100), None)
        .await
        .expect("store answers");
    grew("reserve", g.seq, seq(&s).await);
    let c = resolve(&s, "a", units(100)).await;
    grew("commit", c.seq, seq(&s).await);
    b.advance(1_000);
    let h = heartbeat(&s, "r1").await;
    grew("heartbeat", h.seq, seq(&s).await);
    let cut = s
        .set_cutoff(true, "test".into())
        .await
        .expect("store answers");
    grew("cutoff", cut.seq, seq(&s).await);
    let cut = s
        .set_cutoff(false, String::new())
        .await
        .expect("store answers");
    grew("cutoff off", cut.seq, seq(&s).await);
    let f = finish(&s, "r1").await;
    grew("finish", f.seq, seq(&s).await);
    let last = f.seq;

    usage(&s, &w.scopes()).await;
    reservations(&s).await;
    s.top_counters(None, 10).await.expect("store answers");
    assert_eq!(seq(&s).await, last, "reads change nothing");
    assert_eq!(resolve(&s, "a", units(5)).await.seq, last);
    assert_eq!(finish(&s, "r1").await.seq, last);
    assert_eq!(seq(&s).await, last, "repeats change nothing");
    let mut req = w.run("r2");
    req.input_bytes = u64::MAX;
    admit_refused(&s, req).await;
    assert_eq!(seq(&s).await, last, "refusals change nothing");

    // Dropping records (a finished run past its retention, with its steps) is a change too:
    // an answer that says it changed the ledger carries a seq that moved.
    // r1 finished 1 s after the start; r3 finishes 30 s later.
    b.advance(30_000);
    admit(&s, w.run("r3")).await;
    let keep = finish(&s, "r3").await.seq;
    b.advance(RECORD_RETENTION_MS - 30_000 + 1);
    let again = finish(&s, "r3").await;
    assert!(again.value.repeated);
    assert!(again.changed, "r1's records were dropped: {again:?}");
    assert!(again.seq > keep, "{again:?} after {keep}");
    assert_eq!(again.seq, seq(&s).await);
}

fn hold_of<'a>(all: &'a [Reservation], run: &str) -> &'a Reservation {
    all.iter()
        .find(|r| r.run_id.0 == run && r.kind == ReservationKind::RunHold)
        .unwrap_or_else(|| panic!("no whole-run hold for {run} in {all:?}"))
}

async fn whole_run_store(b: &dyn Backend, ttl_ms: u64) -> Arc<dyn Store> {
    let mut p = policy();
    p.mode = ReservationMode::WholeRun;
    p.run.max_cost = Micros(50_000);
    p.global.budgets = vec![day(1_000_000)];
    p.session.budgets = vec![day(120_000)];
    p.lease_ttl_ms = ttl_ms;
    b.open(p, START).await
}

/// `whole_run`: admission holds the run's cost bound on every scope; steps draw from it
/// without touching the scopes; finish reconciles the scopes to the sum of the step charges.
pub async fn whole_run_reserves_and_reconciles(b: &dyn Backend) {
    let s = whole_run_store(b, 30_000).await;
    let w = Who::new("s1", "c1", "192.0.2.1/32");
    let a = admit(&s, w.run("r1")).await.value;
    assert_eq!(a.reserved, Micros(50_000));
    let lines = check_ledger(&s, &w.scopes()).await;
    assert_eq!(ur(&lines, ScopeKind::Global), (0, 50_000));
    assert_eq!(ur(&lines, ScopeKind::Session), (0, 50_000));

    let g = reserve(&s, tool_step("r1", "t1", TOOL_PER_CALL, 0)).await;
    assert_eq!(g.reserved, Micros(10_000));
    resolve(&s, "t1", units(0)).await;
    reserve(&s, model_step("r1", "m1", 1000, Some(1000))).await;
    let c = resolve(&s, "m1", tokens(1000, 500)).await.value;
    assert_eq!(c.charged, Micros(2_000));
    reserve(&s, tool_step("r1", "t2", TOOL_PER_CALL, 0)).await;
    let lines = check_ledger(&s, &w.scopes()).await;
    assert_eq!(
        ur(&lines, ScopeKind::Global),
        (0, 50_000),
        "steps draw from the hold"
    );
    // 22_000 of 50_000 taken: 28_000 is left, not a micro more.
    // (12_000 used and 10_000 held: the hold refuses, a wait)
    let r = reserve_refused(&s, micros_step("r1", "x", 28_001)).await;
    held_refusal(&r, ScopeKind::Run);
    reserve(&s, micros_step("r1", "y", 28_000)).await;
    resolve(&s, "y", Resolution::Release).await;

    let f = finish(&s, "r1").await.value;
    assert_eq!((f.charged, f.steps), (Micros(22_000), 4));
    let lines = check_ledger(&s, &w.scopes()).await;
    assert_eq!(ur(&lines, ScopeKind::Global), (22_000, 0));
    assert_eq!(ur(&lines, ScopeKind::Session), (22_000, 0));
    let all = reservations(&s).await;
    let steps: u64 = all
        .iter()
        .filter(|r| r.run_id.0 == "r1" && r.kind != ReservationKind::RunHold)
        .map(|r| r.charged.0)
        .sum();
    assert_eq!(steps, 22_000);
    assert_eq!(hold_of(&all, "r1").state, ReservationState::Committed);

    // The session has 120_000 - 22_000 = 98_000: one more hold of 50_000, not two (the
    // second is refused by the first's hold: a wait).
    admit(&s, Who::new("s1", "c2", "192.0.2.1/32").run("r2")).await;
    let r = admit_refused(&s, Who::new("s1", "c3", "192.0.2.1/32").run("r3")).await;
    held_refusal(&r, ScopeKind::Session);
    check_ledger(&s, &Who::new("s1", "c3", "192.0.2.1/32").scopes()).await;
}

/// `whole_run`: a step's overrun reaches the run's scopes at its commit (the hold grows to
/// what the run was charged), as in `per_step`, not only when the run ends: meanwhile the
/// scopes must not admit what the overrun already spent.
pub async fn whole_run_overrun_reaches_the_scopes_at_commit(b: &dyn Backend) {
    let s = whole_run_store(b, 30_000).await;
    let w = Who::new("s1", "c1", "192.0.2.1/32");
    admit(&s, w.run("r1")).await;
    reserve(&s, micros_step("r1", "a", 10_000)).await;
    let c = resolve(&s, "a", units(90_000)).await.value;
    assert!(c.overrun, "{c:?}");
    let lines = check_ledger(&s, &w.scopes()).await;
    assert_eq!(ur(&lines, ScopeKind::Session), (0, 90_000), "the hold grew");
    assert_eq!(ur(&lines, ScopeKind::Global), (0, 90_000));
    assert_eq!(
        hold_of(&reservations(&s).await, "r1").amount,
        Micros(90_000)
    );
    // The session has 120_000 - 90_000 = 30_000 left: no room for a hold of 50_000 (held by
    // r1's grown hold, not yet charged to the session: a wait, spent once r1 ends).
    let r = admit_refused(&s, Who::new("s1", "c2", "192.0.2.1/32").run("r2")).await;
    held_refusal(&r, ScopeKind::Session);
    let f = finish(&s, "r1").await.value;
    assert_eq!(f.charged, Micros(90_000));
    let lines = check_ledger(&s, &w.scopes()).await;
    assert_eq!(ur(&lines, ScopeKind::Session), (90_000, 0));
    let all = reservations(&s).await;
    let h = hold_of(&all, "r1");
    assert_eq!(
        (h.state, h.charged),
        (ReservationState::Committed, Micros(90_000))
    );

    // Grown past a scope's limit, the hold is an overrun there: the scope is closed.
    let w2 = Who::new("s2", "c3", "192.0.2.2/32");
    admit(&s, w2.run("r3")).await;
    reserve(&s, micros_step("r3", "b", 10_000)).await;
    resolve(&s, "b", units(150_000)).await;
    let lines = check_ledger(&s, &w2.scopes()).await;
    assert_eq!(ur(&lines, ScopeKind::Session), (0, 150_000));
    assert!(line(&lines, ScopeKind::Session).overrun);
    b.advance(30_001);
    sweep(&s).await;
    let lines = check_ledger(&s, &w2.scopes()).await;
    assert_eq!(
        ur(&lines, ScopeKind::Session),
        (150_000, 0),
        "expired at its grown hold"
    );
}

/// `whole_run`: a run whose lease lapses is charged its whole hold (or its steps' charges,
/// if an overrun took them above it).
pub async fn whole_run_expiry_charges_the_hold(b: &dyn Backend) {
    let s = whole_run_store(b, 10_000).await;
    let w1 = Who::new("s1", "c1", "192.0.2.1/32");
    let w2 = Who::new("s2", "c2", "192.0.2.2/32");
    admit(&s, w1.run("r1")).await;
    reserve(&s, micros_step("r1", "a", 20_000)).await;
    resolve(&s, "a", units(20_000)).await;
    reserve(&s, micros_step("r1", "b", 20_000)).await;
    admit(&s, w2.run("r2")).await;
    reserve(&s, micros_step("r2", "c", 10_000)).await;
    let c = resolve(&s, "c", units(60_000)).await.value;
    assert!(c.overrun, "{c:?}");

    b.advance(10_001);
    sweep(&s).await;
    let all = reservations(&s).await;
    let h1 = hold_of(&all, "r1");
    assert_eq!(
        (h1.state, h1.charged),
        (ReservationState::Expired, Micros(50_000))
    );
    let h2 = hold_of(&all, "r2");
    assert_eq!(
        (h2.state, h2.charged),
        (ReservationState::Expired, Micros(60_000))
    );
    let bb = reservation(&s, "b").await;
    assert_eq!(
        (bb.state, bb.charged),
        (ReservationState::Expired, Micros(20_000))
    );
    let lines = check_ledger(&s, &w1.scopes()).await;
    assert_eq!(ur(&lines, ScopeKind::Global), (110_000, 0));
    assert_eq!(ur(&lines, ScopeKind::Session), (50_000, 0));
    let lines = check_ledger(&s, &w2.scopes()).await;
    assert_eq!(ur(&lines, ScopeKind::Session), (60_000, 0));

    // A late overrun of the expired step: its run's settled hold follows to what the run was
    // charged, so the scopes count it.
    let late = resolve(&s, "b", units(45_000)).await.value;
    assert_eq!(
        (late.state, late.charged),
        (ReservationState::Expired, Micros(45_000))
    );
    let all = reservations(&s).await;
    let h1 = hold_of(&all, "r1");
    assert_eq!(
        (h1.state, h1.charged),
        (ReservationState::Expired, Micros(65_000))
    );
    let lines = check_ledger(&s, &w1.scopes()).await;
    assert_eq!(ur(&lines, ScopeKind::Global), (125_000, 0));
    assert_eq!(ur(&lines, ScopeKind::Session), (65_000, 0));
}

/// An adjustment with a key applies once: a repeat (an operator's retry after a timeout)
/// answers without applying again; the same key with another adjustment is a conflict;
/// without a key every call applies.
pub async fn adjustments_apply_once_per_key(b: &dyn Backend) {
    let mut p = policy();
    p.session.budgets = vec![day(1_000_000)];
    let s = b.open(p, START).await;
    let session = ScopeKey::new(ScopeKind::Session, "s1");
    let used = |a: &Adjustment| line(&a.lines, ScopeKind::Session).used.0;
    let adjust = |amount: i64, once: Option<&str>| {
        let (s, scope) = (s.clone(), session.clone());
        let once = once.map(str::to_owned);
        async move { s.adjust(scope, 1, amount, once).await }
    };
    let first = adjust(300, Some("k1")).await.expect("applied");
    assert_eq!((used(&first.value), first.value.repeated), (300, false));
    assert!(first.changed);
    let again = adjust(300, Some("k1")).await.expect("repeated");
    assert_eq!((used(&again.value), again.value.repeated), (300, true));
    assert_eq!(seq(&s).await, first.seq, "a repeat changes nothing");
    let conflict = adjust(-300, Some("k1")).await.expect_err("another amount");
    assert!(
        matches!(
            conflict,
            StoreError::Ledger(LedgerError::IdempotencyConflict, _)
        ),
        "{conflict:?}"
    );
    let other = adjust(-100, Some("k2")).await.expect("another key");
    assert_eq!((used(&other.value), other.value.repeated), (200, false));
    for _ in 0..2 {
        adjust(50, None).await.expect("unkeyed");
    }
    let lines = usage(&s, &[(session.clone(), 1)]).await;
    assert_eq!(line(&lines, ScopeKind::Session).used, Micros(300));

    // A charge on top of what is held, past the limit: I1's exception, the scope is closed.
    let w = Who::new("s1", "c1", "192.0.2.1/32");
    admit(&s, w.run("r1")).await;
    reserve(&s, micros_step("r1", "a", 600_000)).await;
    let a = adjust(400_000, None).await.expect("applied");
    let l = line(&a.value.lines, ScopeKind::Session);
    assert_eq!((l.used.0, l.reserved.0), (400_300, 600_000));
    assert!(l.overrun, "{l:?}");
    let r = reserve_refused(&s, micros_step("r1", "b", 1)).await;
    refusal(&r, RefusalCode::BudgetExhausted, ScopeKind::Session);
}

/// With the cutoff engaged nothing new is admitted (runs or steps); work already admitted
/// can still be resolved; disengaged, admission resumes.
pub async fn cutoff_refuses_admission(b: &dyn Backend) {
    let s = b.open(policy(), START).await;
    let w = Who::new("s1", "c1", "192.0.2.1/32");
    admit(&s, w.run("r1")).await;
    reserve(&s, micros_step("r1", "a", 1_000)).await;
    let before = seq(&s).await;
    let c = s
        .set_cutoff(true, "incident".into())
        .await
        .expect("store answers");
    assert!(c.value && c.seq > before, "{c:?}");
    assert_eq!(summary(&s).await.cutoff.as_deref(), Some("incident"));
    let r = admit_refused(&s, Who::new("s2", "c2", "192.0.2.2/32").run("r2")).await;
    refusal(&r, RefusalCode::CutoffEngaged, ScopeKind::Global);
    assert_eq!(
        r.message, CUTOFF_MESSAGE,
        "the operator's reason is not told to guests"
    );
    let r = reserve_refused(&s, micros_step("r1", "b", 1_000)).await;
    refusal(&r, RefusalCode::CutoffEngaged, ScopeKind::Global);
    assert_eq!(r.message, CUTOFF_MESSAGE);
    let c = resolve(&s, "a", units(700)).await.value;
    assert_eq!(c.charged, Micros(700));
    heartbeat(&s, "r1").await;

    let c = s
        .set_cutoff(false, String::new())
        .await
        .expect("store answers");
    assert!(!c.value);
    assert_eq!(summary(&s).await.cutoff, None);
    admit(&s, Who::new("s2", "c2", "192.0.2.2/32").run("r2")).await;
    reserve(&s, micros_step("r1", "b", 1_000)).await;
    let lines = check_ledger(&s, &w.scopes()).await;
    assert_eq!(ur(&lines, ScopeKind::Global), (700, 1_000));
}

/// Limits in dry-run (SPEC §8): a scope whose policy is in dry-run reports the refusal it
/// would give (rate first, then concurrency, then budgets, as enforcement checks) and admits;
/// what it admits is accounted as usual, a budget held past its limit is marked overrun, and
/// the enforced scopes beside it still refuse.
pub async fn dry_run_reports_instead_of_refusing(b: &dyn Backend) {
    let mut p = policy();
    p.global.budgets = vec![day(1_000_000)];
    p.session = ScopePolicy {
        budgets: vec![day(300_000)],
        rate: Some(Rate {
            count: 1,
            period_ms: 60_000,
            burst: 1,
        }),
        concurrency: Some(1),
        dry_run: true,
    };
    let s = b.open(p, START).await;
    let (w1, w2) = (
        Who::new("s1", "c1", "192.0.2.1/32"),
        Who::new("s1", "c2", "192.0.2.1/32"),
    );
    let first = admit(&s, w1.run("r1")).await;
    assert_eq!(first.value.dry_run, None, "nothing to report yet");
    // Past the session's rate (burst 1) and its one active run: admitted, reported.
    let second = admit(&s, w2.run("r2")).await;
    let dry = second.value.dry_run.expect("a dry-run refusal is reported");
    refusal(&dry, RefusalCode::RateLimited, ScopeKind::Session);
    assert!(dry.retry_after_s.is_some_and(|s| s >= 1), "{dry:?}");
    assert_eq!(summary(&s).await.runs_active, 2);

    // Within the session budget: nothing to report.
    let a = reserve(&s, micros_step("r1", "r1.a", 250_000)).await;
    assert_eq!(a.dry_run, None);
    // Past it: granted, the budget refusal reported, the counter marked overrun.
    let b2 = reserve(&s, micros_step("r2", "r2.a", 100_000)).await;
    let dry = b2.dry_run.expect("a dry-run budget refusal is reported");
    // (250_000 held, nothing used: reported as held, a wait)
    held_refusal(&dry, ScopeKind::Session);
    let lines = check_ledger(&s, &w1.scopes()).await;
    let session = line(&lines, ScopeKind::Session);
    assert_eq!(
        (session.reserved.0, session.limit.0),
        (350_000, 300_000),
        "what dry-run admits is held"
    );
    assert!(
        session.overrun,
        "a budget past its limit in dry-run is overrun"
    );
    assert_eq!(ur(&lines, ScopeKind::Global), (0, 350_000));

    // The enforced global budget still refuses (its refusal, not the session's report).
    let r = reserve_refused(&s, micros_step("r1", "r1.b", 700_000)).await;
    held_refusal(&r, ScopeKind::Global);
    let r = reserve_refused(&s, micros_step("r1", "r1.b", 1_000_001)).await;
    refusal(&r, RefusalCode::BudgetExhausted, ScopeKind::Global);
    // So does the enforced one-run-per-conversation cap.
    let r = admit_refused(&s, Who::new("s2", "c1", "192.0.2.2/32").run("r3")).await;
    refusal(&r, RefusalCode::ConcurrencyLimited, ScopeKind::Conversation);

    // Conservation holds as usual.
    resolve(&s, "r1.a", units(250_000)).await;
    resolve(&s, "r2.a", Resolution::Unknown).await;
    finish(&s, "r1").await;
    finish(&s, "r2").await;
    let lines = check_ledger(&s, &w1.scopes()).await;
    assert_eq!(ur(&lines, ScopeKind::Session), (350_000, 0));
    assert_eq!(ur(&lines, ScopeKind::Global), (350_000, 0));
}

/// `whole_run`: `finish` answers what the budgets were charged besides the steps' sum: the
/// hold as committed (the steps' sum) for a finished run, the whole hold for an expired one,
/// and the hold as a late overrun topped it up.
pub async fn whole_run_finish_answers_what_the_budgets_were_charged(b: &dyn Backend) {
    let s = whole_run_store(b, 10_000).await;
    let w1 = Who::new("s1", "c1", "192.0.2.1/32");
    let w2 = Who::new("s2", "c2", "192.0.2.2/32");
    admit(&s, w1.run("r1")).await;
    reserve(&s, micros_step("r1", "a", 20_000)).await;
    resolve(&s, "a", units(18_000)).await;
    let f = finish(&s, "r1").await.value;
    assert_eq!(
        (f.charged, f.budgets_charged),
        (Micros(18_000), Micros(18_000))
    );
    admit(&s, w2.run("r2")).await;
    reserve(&s, micros_step("r2", "b", 20_000)).await;
    resolve(&s, "b", units(18_000)).await;
    reserve(&s, micros_step("r2", "c", 10_000)).await;
    b.advance(10_001);
    let f = finish(&s, "r2").await.value;
    assert_eq!(f.state, RunState::Expired);
    // (the lease ended it first: the finish repeats how it ended, decision 0009)
    assert_eq!(
        (f.charged, f.budgets_charged, f.repeated),
        (Micros(28_000), Micros(50_000), true)
    );
    resolve(&s, "c", units(40_000)).await;
    let f = finish(&s, "r2").await.value;
    assert_eq!(
        (f.charged, f.budgets_charged, f.repeated),
        (Micros(58_000), Micros(58_000), true)
    );
    let lines = check_ledger(&s, &w2.scopes()).await;
    assert_eq!(ur(&lines, ScopeKind::Session), (58_000, 0));
}
