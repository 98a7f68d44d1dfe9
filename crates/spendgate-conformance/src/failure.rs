//! I3 fail closed and I4 one global limit: a store that cannot be written admits nothing and
//! loses no hold; two handles on one store enforce the limits of one.

use crate::support::{
    admit, admit_refused, check_ledger, day, finish, micros_step, model_step, policy, reservation,
    reservations, reserve, resolve, seq, step_id, sweep, units, ur, usage, Who, START,
};
use crate::Backend;
use spendgate_core::{
    Applied, Micros, Refusal, RefusalCode, Reservation, ReservationState, Resolution, Resolved,
    ScopeKey, ScopeKind,
};
use spendgate_store::Store;
use spendgate_store::StoreError;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a recovered store may take to serve again (a reconnect, a reload).
const RECOVERY: Duration = Duration::from_secs(10);

/// An answer given while the store fails: it must be a store error that says so.
fn unavailable<T: std::fmt::Debug>(what: &str, r: Result<T, StoreError>) {
    match r {
        Err(e) if e.is_unavailable() => {}
        other => {
            panic!("I3: {what} while the store fails must be refused as unavailable: {other:?}")
        }
    }
}

/// Retries `f` while the store answers unavailable, at most [`RECOVERY`].
async fn once_recovered<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    let start = Instant::now();
    loop {
        match f().await {
            Ok(v) => return v,
            Err(e) if e.is_unavailable() && start.elapsed() < RECOVERY => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("I3: {what} after the store recovered: {e}"),
        }
    }
}

fn sorted(mut all: Vec<Reservation>) -> Vec<Reservation> {
    all.sort_by(|a, b| a.id.0.cmp(&b.id.0));
    all
}

/// While the store fails, admissions and reservations (one by one and concurrent) are refused
/// as unavailable; once it recovers, none of them holds or charges anything and the ledger is
/// what it was; then service resumes on the same handle.
pub async fn i3_nothing_is_admitted_while_the_store_fails(b: &dyn Backend) {
    let s = b.open(policy(), START).await;
    let w = Who::new("s1", "c1", "192.0.2.1/32");
    let w2 = Who::new("s2", "c2", "192.0.2.2/32");
    let mut scopes = w.scopes();
    scopes.extend(w2.scopes().into_iter().skip(1));
    admit(&s, w.run("r1")).await;
    reserve(&s, micros_step("r1", "before", 1_000)).await;
    let seq_before = seq(&s).await;
    let held_before = sorted(reservations(&s).await);
    let usage_before = usage(&s, &scopes).await;

    if !b.set_failing(true).await {
        eprintln!("i3_nothing_is_admitted_while_the_store_fails: SKIPPED, this backend cannot be made to fail");
        return;
    }
    unavailable("admit", s.admit_run(w2.run("r2"), None).await);
    unavailable(
        "reserve (tool)",
        s.reserve_step(micros_step("r1", "t1", 1_000), None).await,
    );
    unavailable(
        "reserve (model)",
        s.reserve_step(model_step("r1", "m1", 100, Some(100)), None)
            .await,
    );
    let racers = (0..8).map(|i| {
        let s = s.clone();
        tokio::spawn(async move {
            s.reserve_step(micros_step("r1", &format!("c{i}"), 1_000), None)
                .await
        })
    });
    for r in futures::future::join_all(racers).await {
        unavailable("concurrent reserve", r.expect("task"));
    }
    unavailable(
        "concurrent admit",
        s.admit_run(Who::new("s3", "c3", "192.0.2.3/32").run("r3"), None)
            .await,
    );
    assert!(b.set_failing(false).await, "the backend recovers");

    let after = once_recovered("summary", || s.summary()).await;
    assert_eq!(
        after.seq, seq_before,
        "I3: a refused call changed the ledger"
    );
    assert_eq!(
        sorted(reservations(&s).await),
        held_before,
        "I3: a call refused while the store failed holds something after recovery"
    );
    assert_eq!(
        usage(&s, &scopes).await,
        usage_before,
        "I3: a call refused while the store failed charged or holds something"
    );

    // Service resumes on the same handle.
    let a = once_recovered("admit", || s.admit_run(w2.run("r2"), None)).await;
    assert!(a.value.is_ok(), "admitted after recovery: {a:?}");
    reserve(&s, micros_step("r2", "after", 1_000)).await;
    resolve(&s, "after", units(500)).await;
    let lines = check_ledger(&s, &scopes).await;
    assert_eq!(ur(&lines, ScopeKind::Global), (500, 1_000));
}

/// Resolving while the store fails: refused as unavailable, or (a backend that answers before
/// it writes) answered and then lost. Returns the answer when there was one.
fn failed_resolve(what: &str, r: Result<Applied<Resolved>, StoreError>) -> Option<Resolved> {
    match r {
        Err(e) if e.is_unavailable() => None,
        Err(e) => panic!("I3: {what} while the store fails: not an unavailable error: {e}"),
        Ok(a) => {
            eprintln!("{what} while the store fails was answered {a:?}");
            Some(a.value)
        }
    }
}

/// A commit (and a release) that cannot reach the store leave their reservations held: after
/// recovery a retried commit applies once, and the hold nobody resolves expires at the end of
/// the lease charged in full. Failing errs only towards charging more.
pub async fn i3_a_commit_that_cannot_reach_the_store_leaves_the_hold(b: &dyn Backend) {
    let mut p = policy();
    p.lease_ttl_ms = 10_000;
    let s = b.open(p, START).await;
    let w = Who::new("s1", "c1", "192.0.2.1/32");
    admit(&s, w.run("r1")).await;
    reserve(&s, micros_step("r1", "a", 1_000)).await;
    reserve(&s, micros_step("r1", "b", 2_000)).await;
    let seq_before = seq(&s).await;

    if !b.set_failing(true).await {
        eprintln!("i3_a_commit_that_cannot_reach_the_store_leaves_the_hold: SKIPPED, this backend cannot be made to fail");
        return;
    }
    let ra = failed_resolve("commit", s.resolve(step_id("a"), units(400)).await);
    let rb = failed_resolve(
        "release",
        s.resolve(step_id("b"), Resolution::Release).await,
    );
    assert!(b.set_failing(false).await, "the backend recovers");
    once_recovered("summary", || s.summary()).await;

    // Each stays held, unless it was answered and that answer stands.
    let a = reservation(&s, "a").await;
    let b_ = reservation(&s, "b").await;
    match (&ra, a.state) {
        (_, ReservationState::Held) => {}
        (Some(r), st) if st == r.state && a.charged == r.charged => {}
        _ => panic!("I3: a commit that failed left {a:?} (answered {ra:?})"),
    }
    match (&rb, b_.state) {
        (_, ReservationState::Held) => {}
        (Some(r), st) if st == r.state => {}
        _ => panic!("I3: a release that failed left {b_:?} (answered {rb:?})"),
    }
    if ra.is_some() || rb.is_some() {
        eprintln!(
            "after recovery: a is {:?}, b is {:?} (held: the answer given was not kept)",
            a.state, b_.state
        );
    }
    let lines = check_ledger(&s, &w.scopes()).await;
    if a.state == ReservationState::Held && b_.state == ReservationState::Held {
        assert_eq!(
            seq(&s).await,
            seq_before,
            "I3: a failed resolve changed the ledger"
        );
        assert_eq!(ur(&lines, ScopeKind::Global), (0, 3_000));
    }

    // A retried commit applies once.
    let first = resolve(&s, "a", units(400)).await.value;
    assert_eq!(
        (first.state, first.charged),
        (ReservationState::Committed, Micros(400))
    );
    assert_eq!(
        first.repeated,
        a.state != ReservationState::Held,
        "the retry applies exactly when the failed commit did not: {first:?}"
    );
    let again = resolve(&s, "a", units(400)).await.value;
    assert!(again.repeated, "{again:?}");
    assert_eq!(again.charged, Micros(400));

    // The hold nobody resolved is charged in full at expiry.
    b.advance(10_001);
    sweep(&s).await;
    let b_ = reservation(&s, "b").await;
    let lines = check_ledger(&s, &w.scopes()).await;
    if rb.is_some() && b_.state == ReservationState::Released {
        assert_eq!(ur(&lines, ScopeKind::Global), (400, 0));
    } else {
        assert_eq!(
            (b_.state, b_.charged),
            (ReservationState::Expired, Micros(2_000)),
            "I3: the hold a failed release left is charged in full at expiry"
        );
        assert_eq!(ur(&lines, ScopeKind::Global), (2_400, 0));
    }
}

/// Refused with `code` on scope `kind`.
fn refused(r: &Refusal, code: RefusalCode, kind: ScopeKind) {
    assert_eq!((r.code, r.scope), (code, Some(kind)), "{r:?}");
}

/// What one step of [`i4_two_handles_enforce_one_limit`] holds.
const I4_STEP: u64 = 1_000;

/// Two handles on one store (two replicas of the gateway) enforce one set of limits: a run's
/// bounds hold whichever handle serves each step, a conversation has one active run across
/// both, and a global budget is granted exactly once across concurrent tasks that alternate
/// between the handles.
pub async fn i4_two_handles_enforce_one_limit(b: &dyn Backend) {
    let mut p = policy();
    // 3 steps for run "b" and 10 for the race.
    p.global.budgets = vec![day(13 * I4_STEP)];
    p.run.max_tool_calls = 3;
    let s1 = b.open(p, START).await;
    let Some(s2) = b.replica(&s1).await else {
        eprintln!("i4_two_handles_enforce_one_limit: SKIPPED, this backend has no second handle on one store");
        return;
    };
    assert!(!Arc::ptr_eq(&s1, &s2), "a replica is a second handle");
    let handles = [s1.clone(), s2.clone()];

    let wb = run_bounds_across(&handles).await;
    let (wc, wd) = one_run_per_conversation_across(&handles).await;
    let mut who = vec![wb, wc, wd];
    one_global_budget_across(&handles, &mut who).await;

    let mut scopes: Vec<(ScopeKey, u64)> = vec![(ScopeKey::global(), 1)];
    for w in &who {
        scopes.extend(w.scopes().into_iter().skip(1));
    }
    let lines = check_ledger(&s1, &scopes).await;
    assert_eq!(ur(&lines, ScopeKind::Global), (0, 13 * I4_STEP));
    assert_eq!(
        usage(&s2, &scopes).await,
        lines,
        "both handles see one ledger"
    );
    assert_eq!(seq(&s1).await, seq(&s2).await);
}

/// I4, a run's bounds, whichever handle serves each step (concurrent, alternating). Answers
/// who ran.
async fn run_bounds_across(handles: &[Arc<dyn Store>; 2]) -> Who {
    let s2 = &handles[1];
    let wb = Who::new("sb", "cb", "192.0.2.10/32");
    admit(s2, wb.run("b")).await;
    let tries = (0..8).map(|i| {
        let s = handles[i % 2].clone();
        tokio::spawn(async move {
            s.reserve_step(micros_step("b", &format!("b{i}"), I4_STEP), None)
                .await
        })
    });
    let mut granted = 0;
    for r in futures::future::join_all(tries).await {
        let r = r.expect("task").unwrap_or_else(|e| {
            panic!("I4: a step of run b (admitted on one handle) on either handle: {e}")
        });
        match r.value {
            Ok(_) => granted += 1,
            Err(r) => refused(&r, RefusalCode::RunBoundExceeded, ScopeKind::Run),
        }
    }
    assert_eq!(granted, 3, "I4: max_tool_calls = 3 across two handles");
    wb
}

/// I4, one active run per conversation across the handles: one after the other, then racing.
/// Answers who ran.
async fn one_run_per_conversation_across(handles: &[Arc<dyn Store>; 2]) -> (Who, Who) {
    let [s1, s2] = handles;
    let wc = Who::new("sc", "cc", "192.0.2.11/32");
    admit(s1, wc.run("c1")).await;
    let r = admit_refused(s2, wc.run("c2")).await;
    refused(&r, RefusalCode::ConcurrencyLimited, ScopeKind::Conversation);
    let wd = Who::new("sd", "cd", "192.0.2.12/32");
    let racers = (0..6).map(|i| {
        let s = handles[i % 2].clone();
        let req = wd.run(&format!("d{i}"));
        tokio::spawn(async move { s.admit_run(req, None).await })
    });
    let mut admitted = 0;
    for r in futures::future::join_all(racers).await {
        match r.expect("task").expect("admit").value {
            Ok(_) => admitted += 1,
            Err(r) => refused(&r, RefusalCode::ConcurrencyLimited, ScopeKind::Conversation),
        }
    }
    assert_eq!(
        admitted, 1,
        "I4: one active run in conversation cd across two handles"
    );
    finish(s2, "c1").await;
    admit(s1, wc.run("c3")).await;
    (wc, wd)
}

/// I4, one global budget: 8 runs of up to 3 steps each, every step on the other handle than
/// the last, all racing for the 10 steps left. Adds who ran to `who`.
async fn one_global_budget_across(handles: &[Arc<dyn Store>; 2], who: &mut Vec<Who>) {
    for t in 0..8 {
        let w = Who::new(
            &format!("sa{t}"),
            &format!("ca{t}"),
            &format!("192.0.2.{}/32", 20 + t),
        );
        admit(&handles[t % 2], w.run(&format!("a{t}"))).await;
        who.push(w);
    }
    let tasks = (0..8).map(|t| {
        let handles = handles.clone();
        tokio::spawn(async move {
            let run = format!("a{t}");
            let mut granted = 0u64;
            for i in 0..3 {
                let s = &handles[(t + i) % 2];
                match s
                    .reserve_step(micros_step(&run, &format!("{run}-{i}"), I4_STEP), None)
                    .await
                    .expect("reserve")
                    .value
                {
                    Ok(_) => granted += 1,
                    Err(r) => {
                        // (the holds, never resolved here, refuse: a wait)
                        refused(&r, RefusalCode::BudgetHeld, ScopeKind::Global);
                        break;
                    }
                }
            }
            granted
        })
    });
    let granted: u64 = futures::future::join_all(tasks)
        .await
        .into_iter()
        .map(|r| r.expect("task"))
        .sum();
    assert_eq!(
        granted, 10,
        "I4: exactly the global budget across two handles"
    );
}
