//! The usage history: after a mixed load, one record per reservation and per run, and every
//! budget counter's used spend made of the records that name it and the adjustments, to the
//! micro; refusal counts equal the refusals answered. Read through `Store::history()`: a
//! backend whose store keeps none says so and skips.

use crate::support::{
    admit, admit_refused, day, finish, micros_step, model_step, policy, reservations, reserve,
    reserve_refused, resolve, run_id, sweep, tokens, tool_step, units, usage, Who, MIDNIGHT, START,
    TOOL_PER_CALL,
};
use crate::Backend;
use spendgate_core::history::{ReservationRecord, RunRecord};
use spendgate_core::{
    CounterKey, Micros, ReservationMode, ReservationState, Resolution, RunState, ScopeKey,
    ScopeKind, UnixMs,
};
use spendgate_store::{HistoryFilter, HistoryReader, Store};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// Records read per page (small, so that the case pages).
const PAGE: usize = 3;

/// The per_step half of the load: commits, a release, an unknown, an overrun, a finish with a
/// held step, an expiry and its late overrun, an adjustment and refusals. Answers the
/// refusals it was answered.
async fn per_step_load(b: &dyn Backend, s: &Arc<dyn Store>) -> u64 {
    let w1 = Who::new("s1", "c1", "192.0.2.1/32");
    let w2 = Who::new("s2", "c2", "192.0.2.2/32");
    admit(s, w1.run("r1")).await;
    reserve(s, model_step("r1", "m1", 100, Some(100))).await;
    resolve(s, "m1", tokens(100, 50)).await;
    reserve(s, tool_step("r1", "t1", TOOL_PER_CALL, 0)).await;
    resolve(s, "t1", Resolution::Release).await;
    reserve(s, micros_step("r1", "u1", 700)).await;
    resolve(s, "u1", Resolution::Unknown).await;
    reserve(s, micros_step("r1", "o1", 1_000)).await;
    assert!(resolve(s, "o1", units(1_500)).await.value.overrun);
    reserve(s, micros_step("r1", "h1", 400)).await;
    admit(s, w2.run("r2")).await;
    reserve(s, micros_step("r2", "e1", 2_000)).await;
    // Refusals: an input too large (twice), a second run of one conversation, a step of a
    // finished run.
    let mut big = w1.run("x1");
    big.input_bytes = 1 << 20;
    admit_refused(s, big.clone()).await;
    big.run_id = run_id("x2");
    admit_refused(s, big).await;
    admit_refused(s, w1.run("x3")).await;
    let ended = finish(s, "r1").await.value;
    assert_eq!(ended.budgets_charged, ended.charged, "per_step");
    reserve_refused(s, micros_step("r1", "late", 1)).await;
    s.adjust(ScopeKey::new(ScopeKind::Session, "s1"), 1, 5_000, None)
        .await
        .expect("adjusted");
    b.advance(30_001);
    sweep(s).await;
    // A late overrun of the expired step.
    let late = resolve(s, "e1", units(3_000)).await.value;
    assert_eq!(
        (late.state, late.charged),
        (ReservationState::Expired, Micros(3_000))
    );
    4
}

/// The whole_run half: a run finished with a held step, one that expires (its hold charged
/// whole, as `finish` then answers) and a late overrun of its step above the hold.
async fn whole_run_load(b: &dyn Backend, s: &Arc<dyn Store>) -> u64 {
    let w1 = Who::new("s1", "c1", "192.0.2.1/32");
    let w2 = Who::new("s2", "c2", "192.0.2.2/32");
    admit(s, w1.run("r1")).await;
    reserve(s, micros_step("r1", "a", 20_000)).await;
    resolve(s, "a", units(20_000)).await;
    reserve(s, micros_step("r1", "b", 5_000)).await;
    let ended = finish(s, "r1").await.value;
    assert_eq!(
        (ended.charged, ended.budgets_charged),
        (Micros(25_000), Micros(25_000))
    );
    admit(s, w2.run("r2")).await;
    reserve(s, micros_step("r2", "c", 10_000)).await;
    resolve(s, "c", units(9_000)).await;
    reserve(s, micros_step("r2", "d", 10_000)).await;
    b.advance(30_001);
    let ended = finish(s, "r2").await.value;
    assert_eq!(ended.state, RunState::Expired);
    // The case: the steps were charged 19,000, the budgets the whole hold.
    assert_eq!(
        (ended.charged, ended.budgets_charged),
        (Micros(19_000), Micros(50_000))
    );
    let late = resolve(s, "d", units(45_000)).await.value;
    assert_eq!(late.charged, Micros(45_000));
    let again = finish(s, "r2").await.value;
    assert_eq!(again.budgets_charged, Micros(54_000), "the hold followed");
    0
}

/// Every record of the period, page by page.
async fn all_records(h: &dyn HistoryReader) -> (Vec<ReservationRecord>, Vec<RunRecord>) {
    let period = HistoryFilter::period(UnixMs(START.0 - 3_600_000), MIDNIGHT);
    let (mut records, mut runs) = (Vec::new(), Vec::new());
    let mut after: Option<String> = None;
    loop {
        let page = h
            .reservations(&period, after.as_deref(), PAGE)
            .await
            .expect("reservations");
        assert!(page.items.len() <= PAGE);
        records.extend(page.items);
        match page.next {
            Some(n) => after = Some(n),
            None => break,
        }
    }
    let mut after: Option<String> = None;
    loop {
        let page = h.runs(&period, after.as_deref(), PAGE).await.expect("runs");
        runs.extend(page.items);
        match page.next {
            Some(n) => after = Some(n),
            None => break,
        }
    }
    (records, runs)
}

/// The history holds one record per reservation (as the ledger lists it) and per run, the
/// counters' used spend is what the records and adjustments say, and the refusals are
/// counted.
async fn check_history(s: &Arc<dyn Store>, h: &dyn HistoryReader, runs: usize, refused: u64) {
    let (records, run_records) = all_records(h).await;
    let ledger = reservations(s).await;
    let ids: BTreeSet<&str> = records.iter().map(|r| r.id.0.as_str()).collect();
    assert_eq!(ids.len(), records.len(), "one record per reservation");
    assert_eq!(records.len(), ledger.len(), "{records:#?}");
    for r in &ledger {
        let rec = records
            .iter()
            .find(|x| x.id == r.id)
            .unwrap_or_else(|| panic!("no record of {}", r.id.0));
        assert_eq!(
            (rec.state, rec.charged, rec.reserved),
            (r.state, r.charged, r.amount),
            "{}",
            r.id.0
        );
    }
    let run_ids: BTreeSet<&str> = run_records.iter().map(|r| r.id.0.as_str()).collect();
    assert_eq!(
        (run_ids.len(), run_records.len()),
        (runs, runs),
        "{run_records:#?}"
    );
    let mut sums: BTreeMap<CounterKey, i128> = BTreeMap::new();
    for r in &records {
        for k in &r.counters {
            *sums.entry(k.clone()).or_default() += i128::from(r.charged.0);
        }
    }
    let adjustments = h
        .adjustments(UnixMs(START.0 - 3_600_000), MIDNIGHT, 1000)
        .await
        .expect("adjustments");
    for a in &adjustments {
        for (i, k) in a.counters.iter().enumerate() {
            *sums.entry(k.clone()).or_default() += i128::from(a.applied_to(i));
        }
    }
    let mut checked = 0;
    for who in [
        Who::new("s1", "c1", "192.0.2.1/32"),
        Who::new("s2", "c2", "192.0.2.2/32"),
    ] {
        for line in usage(s, &who.scopes()).await {
            let key = CounterKey {
                scope: line.scope.clone(),
                window: line.window,
            };
            let sum = sums.get(&key).copied().unwrap_or(0);
            assert_eq!(
                sum,
                i128::from(line.used.0),
                "{}: the history's charges and adjustments against the ledger's used",
                line.scope
            );
            checked += 1;
        }
    }
    assert!(checked >= 3, "budget counters were checked");
    let counted: u64 = h
        .refusals(UnixMs(START.0 - 3_600_000), MIDNIGHT)
        .await
        .expect("refusals")
        .iter()
        .map(|(_, n)| n)
        .sum();
    assert_eq!(counted, refused, "refusals counted");
}

/// After a mixed load in both modes, the usage history is as exact as the ledger (and, for a
/// durable backend, stays so after a reopen: every record exactly once).
pub async fn history_is_as_exact_as_the_ledger(b: &dyn Backend) {
    for mode in [ReservationMode::PerStep, ReservationMode::WholeRun] {
        let mut p = policy();
        p.mode = mode;
        p.lease_ttl_ms = 30_000;
        p.global.budgets = vec![day(10_000_000)];
        p.session.budgets = vec![day(1_000_000)];
        p.ip.budgets = vec![day(2_000_000)];
        if mode == ReservationMode::WholeRun {
            p.run.max_cost = Micros(50_000);
        }
        let s = b.open(p, START).await;
        let Some(h) = s.history() else {
            eprintln!(
                "SKIPPED history_is_as_exact_as_the_ledger: the {} store keeps no history \
                 reader (Store::history() is None)",
                s.kind()
            );
            return;
        };
        let refused = match mode {
            ReservationMode::PerStep => per_step_load(b, &s).await,
            ReservationMode::WholeRun => whole_run_load(b, &s).await,
        };
        check_history(&s, h.as_ref(), 2, refused).await;
        drop((s, h));
        if let Some(s) = b.reopen().await {
            let h = s.history().expect("a reopened store keeps its history");
            check_history(&s, h.as_ref(), 2, refused).await;
        }
    }
}
