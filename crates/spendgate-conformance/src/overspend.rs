//! I1 no overspend: admission is all-or-nothing over every scope; `used + reserved <= limit`
//! after every operation; an overrun is charged in full and closes its scope until the window
//! resets.

use crate::support::{
    admit, admit_refused, check_ledger, day, finish, held_refusal, line, micros_step, model_step,
    policy, reservations, reserve, reserve_refused, resolve, seq, summary, tokens, units, ur, Who,
    MIDNIGHT, SECS_TO_MIDNIGHT, START,
};
use crate::Backend;
use spendgate_core::{
    Budget, Micros, Rate, Refusal, RefusalCode, ReservationState, Resolution, ScopeKind, UsageLine,
    Window, LIFETIME_RETRY_AFTER_S,
};
use spendgate_store::Store;
use std::sync::Arc;

/// Everything a refusal must leave as it was: the ledger sequence, every usage line of these
/// identities and the reservations.
async fn snapshot(s: &Arc<dyn Store>, who: &[&Who]) -> (u64, Vec<Vec<UsageLine>>, usize) {
    let mut lines = Vec::new();
    for w in who {
        lines.push(check_ledger(s, &w.scopes()).await);
    }
    (seq(s).await, lines, reservations(s).await.len())
}

fn budget_refusal(r: &Refusal, scope: ScopeKind) {
    assert_eq!(r.code, RefusalCode::BudgetExhausted, "{r:?}");
    assert_eq!(r.scope, Some(scope), "{r:?}");
    assert_eq!(
        r.retry_after_s,
        Some(SECS_TO_MIDNIGHT),
        "a spent day budget retries at midnight: {r:?}"
    );
}

/// Several spent budgets refuse a step: the refusal names the one that frees last and waits
/// for it (a client that obeys `Retry-After` is not refused again by another spent budget),
/// whatever order the scopes are checked in.
pub async fn i1_a_refusal_waits_for_the_spent_budget_that_frees_last(b: &dyn Backend) {
    let mut p = policy();
    p.global.budgets = vec![Budget::new(Micros(150_000), Window::Hour), day(1_000_000)];
    p.session.budgets = vec![day(100_000)];
    p.conversation.budgets = vec![Budget::new(Micros(100_000), Window::Lifetime)];
    let s = b.open(p, START).await;
    // s1 on c1 spends its session's day and its conversation's lifetime: the lifetime
    // budget (a day away) frees after midnight.
    let w1 = Who::new("s1", "c1", "192.0.2.1/32");
    admit(&s, w1.run("r1")).await;
    reserve(&s, micros_step("r1", "r1.a", 100_000)).await;
    resolve(&s, "r1.a", units(100_000)).await;
    let r = reserve_refused(&s, micros_step("r1", "r1.b", 1)).await;
    assert_eq!(
        (r.code, r.scope, r.retry_after_s),
        (
            RefusalCode::BudgetExhausted,
            Some(ScopeKind::Conversation),
            Some(LIFETIME_RETRY_AFTER_S)
        ),
        "a spent lifetime budget frees last: {r:?}"
    );
    finish(&s, "r1").await;
    // s2 fills the global hour.
    let w2 = Who::new("s2", "c2", "192.0.2.1/32");
    admit(&s, w2.run("r2")).await;
    reserve(&s, micros_step("r2", "r2.a", 50_000)).await;
    resolve(&s, "r2.a", units(50_000)).await;
    finish(&s, "r2").await;
    // s1 on a new conversation: the global hour (checked first, free within the hour) and the
    // session's day are spent, so the run is refused (a run needs room to start): midnight.
    let w3 = Who::new("s1", "c3", "192.0.2.1/32");
    let r = admit_refused(&s, w3.run("r3")).await;
    budget_refusal(&r, ScopeKind::Session);
}

/// Each of global, ip, session and conversation in turn is the one scope without room: the
/// step is refused by that scope, and no counter of any scope moves. A step that fills the
/// global budget exactly is granted. (Each refusal here is by holds of steps in flight, with
/// used spend alone leaving room: `budget_held`, a wait.)
pub async fn i1_admission_is_all_or_nothing(b: &dyn Backend) {
    let mut p = policy();
    p.global.budgets = vec![day(1_000_000)];
    p.ip.budgets = vec![day(500_000)];
    p.session.budgets = vec![day(300_000)];
    p.conversation.budgets = vec![day(200_000)];
    let s = b.open(p, START).await;
    let a1 = Who::new("s1", "c1", "192.0.2.1/32");
    let a2 = Who::new("s1", "c2", "192.0.2.1/32");
    let a3 = Who::new("s2", "c3", "192.0.2.1/32");
    let a4 = Who::new("s3", "c4", "192.0.2.1/32");
    let b5 = Who::new("s4", "c5", "198.51.100.1/32");
    let c6 = Who::new("s5", "c6", "198.51.100.2/32");
    let d7 = Who::new("s6", "c7", "198.51.100.3/32");
    let everyone = [&a1, &a2, &a3, &a4, &b5, &c6, &d7];

    // Conversation c1 has 50_000 left; everything else has more.
    admit(&s, a1.run("r1")).await;
    reserve(&s, micros_step("r1", "r1.a", 150_000)).await;
    let before = snapshot(&s, &everyone).await;
    let r = reserve_refused(&s, micros_step("r1", "r1.b", 60_000)).await;
    held_refusal(&r, ScopeKind::Conversation);
    assert_eq!(
        snapshot(&s, &everyone).await,
        before,
        "refusal moved a counter"
    );
    resolve(&s, "r1.a", units(150_000)).await;
    finish(&s, "r1").await;

    // Session s1: 150_000 used + 100_000 held of 300_000.
    admit(&s, a2.run("r2")).await;
    reserve(&s, micros_step("r2", "r2.a", 100_000)).await;
    let before = snapshot(&s, &everyone).await;
    let r = reserve_refused(&s, micros_step("r2", "r2.b", 60_000)).await;
    held_refusal(&r, ScopeKind::Session);
    assert_eq!(
        snapshot(&s, &everyone).await,
        before,
        "refusal moved a counter"
    );

    // Ip 192.0.2.1/32: 250_000 (s1) + 200_000 (s2) of 500_000. c3 is filled exactly.
    admit(&s, a3.run("r3")).await;
    reserve(&s, micros_step("r3", "r3.a", 200_000)).await;
    let lines = check_ledger(&s, &a3.scopes()).await;
    assert_eq!(ur(&lines, ScopeKind::Conversation), (0, 200_000));
    assert_eq!(ur(&lines, ScopeKind::Ip), (150_000, 300_000));
    admit(&s, a4.run("r4")).await;
    let before = snapshot(&s, &everyone).await;
    let r = reserve_refused(&s, micros_step("r4", "r4.a", 60_000)).await;
    held_refusal(&r, ScopeKind::Ip);
    assert_eq!(
        snapshot(&s, &everyone).await,
        before,
        "refusal moved a counter"
    );

    // Global: 450_000 + 200_000 + 200_000 = 850_000 of 1_000_000.
    admit(&s, b5.run("r5")).await;
    reserve(&s, micros_step("r5", "r5.a", 200_000)).await;
    admit(&s, c6.run("r6")).await;
    reserve(&s, micros_step("r6", "r6.a", 200_000)).await;
    admit(&s, d7.run("r7")).await;
    let before = snapshot(&s, &everyone).await;
    let r = reserve_refused(&s, micros_step("r7", "r7.a", 160_000)).await;
    held_refusal(&r, ScopeKind::Global);
    assert_eq!(
        snapshot(&s, &everyone).await,
        before,
        "refusal moved a counter"
    );

    // Exactly the rest fits; then nothing does.
    let g = reserve(&s, micros_step("r7", "r7.b", 150_000)).await;
    assert_eq!(g.reserved, Micros(150_000));
    let lines = check_ledger(&s, &d7.scopes()).await;
    assert_eq!(ur(&lines, ScopeKind::Global), (150_000, 850_000));
    let r = reserve_refused(&s, micros_step("r7", "r7.c", 1)).await;
    held_refusal(&r, ScopeKind::Global);
    for w in everyone {
        check_ledger(&s, &w.scopes()).await;
    }
}

/// A refused admission takes no rate token, no concurrency slot and no budget.
pub async fn i1_refused_admission_holds_nothing(b: &dyn Backend) {
    let mut p = policy();
    p.session.budgets = vec![day(100_000)];
    p.session.rate = Some(Rate {
        count: 2,
        period_ms: 60_000,
        burst: 2,
    });
    let s = b.open(p, START).await;
    let w1 = Who::new("s1", "c1", "192.0.2.1/32");
    let w2 = Who::new("s1", "c2", "192.0.2.1/32");
    let w3 = Who::new("s1", "c3", "192.0.2.1/32");
    admit(&s, w1.run("r1")).await;
    reserve(&s, micros_step("r1", "r1.a", 100_000)).await;

    let before = snapshot(&s, &[&w1, &w2]).await;
    // (per_step's up-front check: the session's budget is all held, none used: a wait)
    let r = admit_refused(&s, w2.run("r2")).await;
    held_refusal(&r, ScopeKind::Session);
    assert_eq!(
        snapshot(&s, &[&w1, &w2]).await,
        before,
        "refusal moved a counter"
    );

    // Room again: the second (last) rate token and conversation c2's slot are still free.
    resolve(&s, "r1.a", Resolution::Release).await;
    admit(&s, w2.run("r2b")).await;
    let r = admit_refused(&s, w3.run("r3")).await;
    assert_eq!(r.code, RefusalCode::RateLimited, "{r:?}");
    assert_eq!(r.scope, Some(ScopeKind::Session), "{r:?}");
    check_ledger(&s, &w3.scopes()).await;
}

/// A commit above its reservation is charged in full and reported as an overrun. Above the
/// limit it closes the scope (and only that scope) until the window resets; within the
/// limit it does not.
pub async fn i1_overrun_is_charged_and_blocks_until_next_window(b: &dyn Backend) {
    let mut p = policy();
    p.global.budgets = vec![day(1_000_000)];
    p.session.budgets = vec![day(100_000)];
    let s = b.open(p, START).await;
    let w1 = Who::new("s1", "c1", "192.0.2.1/32");
    let w2 = Who::new("s2", "c3", "192.0.2.2/32");

    admit(&s, w1.run("r1")).await;
    let g = reserve(&s, model_step("r1", "r1.m", 1000, Some(1000))).await;
    assert_eq!(g.reserved, Micros(3000));
    let c = resolve(&s, "r1.m", tokens(1000, 60_000)).await.value;
    assert_eq!(c.state, ReservationState::Committed);
    assert_eq!(c.charged, Micros(121_000), "an overrun is charged in full");
    assert_eq!(c.reserved, Micros(3000));
    assert!(c.overrun && !c.repeated, "{c:?}");
    let lines = check_ledger(&s, &w1.scopes()).await;
    let sl = line(&lines, ScopeKind::Session);
    assert_eq!(
        (sl.used, sl.reserved, sl.overrun),
        (Micros(121_000), Micros(0), true)
    );
    let gl = line(&lines, ScopeKind::Global);
    assert_eq!((gl.used, gl.overrun), (Micros(121_000), false));
    assert_eq!(summary(&s).await.overruns, 1);

    // The session admits nothing more today, neither steps nor runs.
    let r = reserve_refused(&s, micros_step("r1", "r1.t", 1)).await;
    budget_refusal(&r, ScopeKind::Session);
    finish(&s, "r1").await;
    let r = admit_refused(&s, Who::new("s1", "c2", "192.0.2.1/32").run("r2")).await;
    budget_refusal(&r, ScopeKind::Session);

    // Other sessions still spend; an overrun within the limit closes nothing.
    admit(&s, w2.run("r3")).await;
    reserve(&s, model_step("r3", "r3.m", 100, Some(100))).await;
    let c = resolve(&s, "r3.m", tokens(100, 200)).await.value;
    assert_eq!((c.charged, c.overrun), (Micros(500), true));
    reserve(&s, micros_step("r3", "r3.t", 1000)).await;
    let lines = check_ledger(&s, &w2.scopes()).await;
    assert!(lines.iter().all(|l| !l.overrun), "{lines:?}");
    assert_eq!(ur(&lines, ScopeKind::Session), (500, 1000));
    finish(&s, "r3").await;
    assert_eq!(summary(&s).await.overruns, 2);

    // A new day is a new window: s1 spends again, from zero.
    b.advance(MIDNIGHT.0 - START.0 + 1000);
    admit(&s, w1.run("r4")).await;
    let lines = check_ledger(&s, &w1.scopes()).await;
    let sl = line(&lines, ScopeKind::Session);
    assert_eq!(sl.window.to_string(), "day:2026-12-01");
    assert_eq!(
        (sl.used, sl.reserved, sl.overrun),
        (Micros(0), Micros(0), false)
    );
    assert_eq!(sl.resets_at, Some(MIDNIGHT.plus_ms(86_400_000)));
    let g = reserve(&s, micros_step("r4", "r4.a", 100_000)).await;
    assert_eq!(g.reserved, Micros(100_000));
    check_ledger(&s, &w1.scopes()).await;
}
