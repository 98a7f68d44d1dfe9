//! The Redis ledger's history drained into PostgreSQL: a private `redis-server` and a private
//! PostgreSQL server (spendgate-testkit), a scripted mixed load through the store API, and the
//! history checked against the ledger to the micro, also after drains interrupted anywhere.

use spendgate_conformance::support::{
    self as cs, admit, admit_refused, finish, micros_step, model_step, reserve, reserve_refused,
    resolve, tokens, units, Who,
};
use spendgate_core::history::{HistoryEvent, RunRecord};
use spendgate_core::{Policy, Resolution, ScopeKey, ScopeKind, UnixMs, UsageLine, Window};
use spendgate_history_pg::{totals, PgHistory};
use spendgate_redis::history::{Drain, HistorySink};
use spendgate_redis::{ClockSource, InitMode, RedisOptions, RedisStore};
use spendgate_store::{Clock, HistoryFilter, HistoryReader, ManualClock, Page, Store};
use spendgate_testkit::{PostgresServer, RedisServer};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

const START: UnixMs = cs::START;

fn redis() -> RedisServer {
    RedisServer::start(spendgate_testkit::RedisOptions::default())
        .unwrap_or_else(|e| panic!("cannot start a private redis-server: {e}"))
}

fn postgres() -> PostgresServer {
    PostgresServer::start().unwrap_or_else(|e| panic!("cannot start a private PostgreSQL: {e}"))
}

/// Budgets on every scope kind, so that every counter is checked.
fn policy() -> Policy {
    let mut p = cs::policy();
    p.ip.budgets = vec![cs::day(50_000_000)];
    p.session.budgets = vec![cs::day(20_000_000)];
    p.conversation.budgets = vec![cs::day(10_000_000)];
    p
}

async fn open(server: &RedisServer, clock: Arc<ManualClock>) -> Arc<RedisStore> {
    open_with(server, clock, policy()).await
}

async fn open_with(
    server: &RedisServer,
    clock: Arc<ManualClock>,
    policy: Policy,
) -> Arc<RedisStore> {
    let opts = RedisOptions {
        url: server.url(),
        prefix: "hist".into(),
        timeout: Duration::from_secs(5),
        slow_grace: Duration::ZERO,
        clock: ClockSource::Manual(clock as Arc<dyn Clock>),
        ledger_id: None,
        witness: None,
    };
    let done = RedisStore::init(&opts, InitMode::Routine)
        .await
        .unwrap_or_else(|e| panic!("store init: {e}"));
    let opts = RedisOptions {
        ledger_id: Some(done.ledger().to_string()),
        ..opts
    };
    Arc::new(
        RedisStore::open(opts, policy)
            .await
            .unwrap_or_else(|e| panic!("open: {e}")),
    )
}

fn who(i: usize) -> Who {
    Who::new(
        &format!("s{}", i % 3),
        &format!("c{i}"),
        &format!("10.0.0.{}/32", i % 2),
    )
}

/// The scripted load: runs that commit model and tool steps, release, report unknown,
/// overrun at commit and late, expire, get refused; an adjustment and a credit. Returns the
/// ids of every run it admitted and of every step it reserved.
async fn load(s: &Arc<dyn Store>, clock: &ManualClock, tag: &str, n: usize) -> Made {
    let mut made = Made::default();
    for i in 0..n {
        let w = who(i);
        let run = format!("{tag}-r{i}");
        admit(s, w.run(&run)).await;
        made.runs.push(run.clone());
        let step = |k: &str| format!("{run}-{k}");
        for k in ["m", "t", "rel"] {
            made.steps.push(step(k));
        }
        if i.is_multiple_of(3) {
            made.steps.push(step("u"));
            made.late += 1;
        }
        if i % 4 == 1 {
            made.steps.push(step("o"));
        }
        if i % 2 == 1 {
            made.steps.push(step("h"));
        }
        reserve(s, model_step(&run, &step("m"), 100, Some(50))).await;
        resolve(s, &step("m"), tokens(80, 20 + i as u64)).await;
        reserve(s, micros_step(&run, &step("t"), 300)).await;
        resolve(s, &step("t"), units(250)).await;
        reserve(s, micros_step(&run, &step("rel"), 700)).await;
        resolve(s, &step("rel"), Resolution::Release).await;
        if i.is_multiple_of(3) {
            // unknown, then a late commit above what it was charged
            reserve(s, model_step(&run, &step("u"), 10, Some(10))).await;
            resolve(s, &step("u"), Resolution::Unknown).await;
            resolve(s, &step("u"), tokens(10, 40)).await;
        }
        if i % 4 == 1 {
            // an overrun at commit
            reserve(s, model_step(&run, &step("o"), 10, Some(5))).await;
            resolve(s, &step("o"), tokens(10, 30)).await;
        }
        if i % 5 == 2 {
            // a refusal: a second run on the conversation (one at a time)
            admit_refused(s, w.run(&format!("{run}-x"))).await;
            reserve_refused(s, model_step(&run, &step("big"), 1_000_000, None)).await;
        }
        if i.is_multiple_of(2) {
            // a tool result's size, kept as the run's largest
            made.steps.push(step("b"));
            reserve(s, micros_step(&run, &step("b"), 50)).await;
            let bytes =
                Resolution::Commit(spendgate_core::Settlement::ResultBytes(1_000 + i as u64));
            resolve(s, &step("b"), bytes).await;
            finish(s, &run).await;
        } else {
            // left held: it expires with the run
            reserve(s, micros_step(&run, &step("h"), 900)).await;
        }
    }
    // the unfinished runs' leases run out
    clock.advance_ms(31_000);
    cs::sweep(s).await;
    cs::sweep(s).await;
    let session = ScopeKey::new(ScopeKind::Session, "s1");
    s.adjust(session.clone(), 1, 5_000, None)
        .await
        .expect("adjust");
    s.adjust(session, 1, -1_000, None).await.expect("credit");
    // a credit on a session that spent nothing moves its counter by nothing
    let idle = ScopeKey::new(ScopeKind::Session, "idle");
    s.adjust(idle, 1, -1_000_000, None).await.expect("credit");
    made
}

/// What a load made.
#[derive(Default)]
struct Made {
    runs: Vec<String>,
    steps: Vec<String>,
    /// Late overruns (records written twice).
    late: usize,
}

impl Made {
    fn extend(&mut self, other: Made) {
        self.runs.extend(other.runs);
        self.steps.extend(other.steps);
        self.late += other.late;
    }
}

fn scopes() -> Vec<(ScopeKey, u64)> {
    let mut v = vec![(ScopeKey::global(), 1)];
    for i in 0..2 {
        v.push((ScopeKey::new(ScopeKind::Ip, format!("10.0.0.{i}/32")), 1));
    }
    for i in 0..3 {
        v.push((ScopeKey::new(ScopeKind::Session, format!("s{i}")), 1));
    }
    v.push((ScopeKey::new(ScopeKind::Session, "idle"), 1));
    for i in 0..64 {
        v.push((ScopeKey::new(ScopeKind::Conversation, format!("c{i}")), 1));
    }
    v
}

fn line_key(l: &UsageLine) -> String {
    format!(
        "{}:{}|{}|{}",
        l.scope.kind.name(),
        l.scope.id,
        l.window.window.name(),
        l.window.index
    )
}

/// Every budget counter's used spend equals the history's charges and adjustments to it.
async fn check_sums(s: &Arc<dyn Store>, pg: &PgHistory) {
    let lines = s.usage(scopes()).await.expect("usage");
    let sums: BTreeMap<String, i64> = totals(pg).await.expect("totals").into_iter().collect();
    let mut checked = 0;
    for l in &lines {
        if l.window.window != Window::Day {
            continue;
        }
        let k = line_key(l);
        let in_history = sums.get(&k).copied().unwrap_or(0);
        assert_eq!(
            in_history, l.used.0 as i64,
            "counter {k}: the history holds {in_history} micros, the ledger used {}",
            l.used.0
        );
        checked += u64::from(l.used.0 > 0);
    }
    assert!(
        checked >= 6,
        "too few counters with spend to check: {checked}"
    );
}

/// Drains until nothing is left (at most `max` passes).
async fn drain_all(d: &Drain, max: usize) {
    for _ in 0..max {
        if d.pass().await.expect("drain pass") == 0 {
            return;
        }
    }
    panic!("the drain did not finish in {max} passes");
}

/// The history holds exactly one record per reservation and per run the ledger made.
async fn check_once(pg: &PgHistory, made: &Made) {
    let want: BTreeSet<String> = made.steps.iter().cloned().collect();
    let runs = &made.runs;
    let period = HistoryFilter::period(UnixMs(0), UnixMs(u64::MAX / 2));
    let mut got = Vec::new();
    let mut after = None;
    loop {
        let page = pg
            .reservations(&period, after.as_deref(), 7)
            .await
            .expect("read reservations");
        got.extend(page.items.into_iter().map(|r| r.id.0));
        match page.next {
            Some(n) => after = Some(n),
            None => break,
        }
    }
    let got_set: BTreeSet<String> = got.iter().cloned().collect();
    assert_eq!(got.len(), got_set.len(), "a reservation record read twice");
    assert_eq!(
        got_set, want,
        "reservation records differ from the ledger's"
    );
    let run_page = pg.runs(&period, None, 10_000).await.expect("read runs");
    let got_runs: BTreeSet<String> = run_page.items.iter().map(|r| r.id.0.clone()).collect();
    let want_runs: BTreeSet<String> = runs.iter().cloned().collect();
    assert_eq!(got_runs, want_runs);
    assert_eq!(run_page.items.len(), runs.len());
}

/// Each run's record: its cost (what its steps were charged), its figures; each reservation
/// record's result size and usage. Returns the run records.
async fn check_records(pg: &PgHistory) -> Page<RunRecord> {
    // per run: its record's cost is what its steps were charged
    let period = HistoryFilter::period(UnixMs(0), UnixMs(u64::MAX / 2));
    let records = pg.reservations(&period, None, 10_000).await.expect("read");
    let mut by_run: BTreeMap<String, u64> = BTreeMap::new();
    for r in &records.items {
        *by_run.entry(r.run_id.0.clone()).or_default() += r.charged.0;
    }
    let run_records = pg.runs(&period, None, 10_000).await.expect("runs");
    for r in &run_records.items {
        assert!(
            r.cost.0 <= by_run[&r.id.0],
            "run {} cost {} above its steps",
            r.id.0,
            r.cost.0
        );
        assert_eq!(r.input_bytes, 100);
        assert_eq!(r.context_tokens, 100);
        let i: u64 = r.id.0.trim_start_matches("a-r").parse().expect("run index");
        // reported completions, and the bound of a step whose usage was unknown when it ended
        let out =
            20 + i + if i.is_multiple_of(3) { 10 } else { 0 } + if i % 4 == 1 { 30 } else { 0 };
        assert_eq!(r.output_tokens, out, "run {}", r.id.0);
        let trb = if i.is_multiple_of(2) { 1_000 + i } else { 0 };
        assert_eq!(r.tool_result_bytes, trb, "run {}", r.id.0);
        let ended = if i.is_multiple_of(2) {
            spendgate_core::RunState::Finished
        } else {
            spendgate_core::RunState::Expired
        };
        assert_eq!(r.ended, ended);
        let rounds = 1 + u32::from(i.is_multiple_of(3)) + u32::from(i % 4 == 1);
        assert_eq!((r.rounds, r.tool_calls), (rounds, 3), "run {}", r.id.0);
    }
    let bytes: Vec<u64> = records
        .items
        .iter()
        .filter_map(|r| r.result_bytes)
        .collect();
    assert_eq!(
        bytes.len(),
        10,
        "every result size committed is in its record"
    );
    let usage = records
        .items
        .iter()
        .find(|r| r.id.0 == "a-r3-m")
        .and_then(|r| r.usage);
    assert_eq!(
        usage.map(|u| (u.prompt_tokens, u.completion_tokens)),
        Some((80, 23))
    );
    run_records
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_history_equals_the_ledger_to_the_micro() {
    let server = redis();
    let pgs = postgres();
    let clock = Arc::new(ManualClock::new(START));
    let store = open(&server, clock.clone()).await;
    let s: Arc<dyn Store> = store.clone();
    let made = load(&s, &clock, "a", 20).await;
    let pg = Arc::new(PgHistory::new(&pgs.url()));
    // the refusal minutes are drained once the ledger's clock is past them
    clock.advance_ms(120_000);
    cs::sweep(&s).await;
    let d = Drain::new(
        store.clone(),
        Some(pg.clone() as Arc<dyn HistorySink>),
        "r1".into(),
    );
    drain_all(&d, 100).await;
    check_once(&pg, &made).await;
    check_sums(&s, &pg).await;
    let run_records = check_records(&pg).await;
    let refused: u64 = pg
        .refusals(UnixMs(0), UnixMs(u64::MAX / 2))
        .await
        .expect("refusals")
        .iter()
        .map(|(_, n)| n)
        .sum();
    assert_eq!(refused, 8, "4 refused admissions and 4 refused steps");
    let refused_runs = run_records
        .items
        .iter()
        .filter(|r| !r.refused.is_empty())
        .count();
    assert_eq!(refused_runs, 4);
    let adjustments = pg
        .adjustments_in(UnixMs(0), UnixMs(u64::MAX / 2), 100)
        .await
        .expect("adjustments");
    let moved: Vec<(i64, Vec<i64>)> = adjustments
        .iter()
        .map(|a| {
            (
                a.amount_micros,
                a.counters.iter().map(|_| a.amount_micros).collect(),
            )
        })
        .collect();
    assert_eq!(
        moved,
        vec![(5_000, vec![5_000]), (-1_000, vec![-1_000]), (0, vec![0])]
    );
    // drained twice: nothing changes
    let again = Drain::new(
        store.clone(),
        Some(pg.clone() as Arc<dyn HistorySink>),
        "r2".into(),
    );
    assert_eq!(again.pass().await.expect("pass"), 0);
    check_sums(&s, &pg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_interrupted_anywhere_loses_nothing_and_duplicates_nothing() {
    let server = redis();
    let mut pgs = postgres();
    let clock = Arc::new(ManualClock::new(START));
    let store = open(&server, clock.clone()).await;
    let s: Arc<dyn Store> = store.clone();
    let pg = Arc::new(PgHistory::new(&pgs.url()));
    let sink = || Some(pg.clone() as Arc<dyn HistorySink>);
    let idle = Duration::from_millis(200);
    let mut made = load(&s, &clock, "b1", 12).await;

    // killed after the insert, before the acknowledgement
    let d1 = Drain::new(store.clone(), sink(), "r1".into()).with_claim_idle(idle);
    let batch = d1.take().await.expect("take");
    assert!(!batch.is_empty());
    d1.write(&batch, false).await.expect("write");
    drop(d1);
    // killed after it took a batch, before the insert
    made.extend(load(&s, &clock, "b2", 6).await);
    let d2 = Drain::new(store.clone(), sink(), "r2".into()).with_claim_idle(idle);
    let _ = d2.take().await.expect("take");
    drop(d2);
    // PostgreSQL down while a third drains: its batch stays pending
    made.extend(load(&s, &clock, "b3", 6).await);
    pgs.kill();
    let d3 = Drain::new(store.clone(), sink(), "r3".into()).with_claim_idle(idle);
    assert!(
        d3.pass().await.is_err(),
        "a drain with PostgreSQL down must fail"
    );
    drop(d3);
    pgs.restart().expect("restart postgres");

    // another replica resumes: claims what the dead ones left, drains the rest
    tokio::time::sleep(idle * 2).await;
    clock.advance_ms(120_000);
    cs::sweep(&s).await;
    let d4 = Drain::new(store.clone(), sink(), "r4".into()).with_claim_idle(idle);
    for _ in 0..100 {
        let n = d4.pass().await.expect("pass");
        d4.measure().await.expect("measure");
        if n == 0
            && d4
                .status()
                .pending
                .load(std::sync::atomic::Ordering::Relaxed)
                == 0
        {
            break;
        }
        tokio::time::sleep(idle).await;
    }
    assert_eq!(
        d4.status()
            .pending
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    assert_eq!(
        d4.status()
            .evicted
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    check_once(&pg, &made).await;
    check_sums(&s, &pg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_postgres_the_stream_is_the_history() {
    let server = redis();
    let clock = Arc::new(ManualClock::new(START));
    let store = open(&server, clock.clone()).await;
    let s: Arc<dyn Store> = store.clone();
    let made = load(&s, &clock, "c", 10).await;
    let reader = s.history().expect("a redis store keeps a history");
    assert_eq!(reader.kind(), "redis-stream");
    let period = HistoryFilter::period(UnixMs(0), UnixMs(u64::MAX / 2));
    let all = cs::reservations(&s).await;
    let page = reader
        .reservations(&period, None, 10_000)
        .await
        .expect("read");
    assert_eq!(page.items.len(), all.len());
    assert_eq!(page.items.len(), made.steps.len());
    // a late overrun was written twice; the reader keeps the larger charge
    let charged: u64 = page.items.iter().map(|r| r.charged.0).sum();
    let ledger: u64 = all.iter().map(|r| r.charged.0).sum();
    assert_eq!(charged, ledger);
    let run_page = reader.runs(&period, None, 10_000).await.expect("runs");
    assert_eq!(run_page.items.len(), made.runs.len());
    let refused: u64 = reader
        .refusals(UnixMs(0), UnixMs(u64::MAX / 2))
        .await
        .expect("refusals")
        .iter()
        .map(|(_, n)| n)
        .sum();
    assert_eq!(refused, 4);
    let stream = store.history_stream();
    let adjustments = stream
        .adjustments_in(UnixMs(0), UnixMs(u64::MAX / 2), 100)
        .await
        .expect("adjustments");
    assert_eq!(adjustments.len(), 3);
    assert_eq!(adjustments[0].counters[0].scope.id, "s1");
    // the drain without a sink tells the tap, once
    struct Count(std::sync::atomic::AtomicUsize);
    impl spendgate_store::HistoryTap for Count {
        fn seen(&self, events: &[HistoryEvent]) {
            self.0
                .fetch_add(events.len(), std::sync::atomic::Ordering::Relaxed);
        }
    }
    let tap = Arc::new(Count(Default::default()));
    s.tap_history(tap.clone());
    let d = Drain::new(store.clone(), None, "r1".into());
    drain_all(&d, 100).await;
    let d2 = Drain::new(store.clone(), None, "r2".into());
    drain_all(&d2, 100).await;
    let seen = tap.0.load(std::sync::atomic::Ordering::Relaxed);
    // every record once (a late overrun's twice), the runs', the three adjustments'
    assert_eq!(seen, made.steps.len() + made.late + made.runs.len() + 3);
    // kept in the stream after the drain
    let again = reader
        .reservations(&period, None, 10_000)
        .await
        .expect("read");
    assert_eq!(again.items.len(), all.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_run_hold_is_in_the_history_as_its_budgets_were_charged() {
    let server = redis();
    let pgs = postgres();
    let clock = Arc::new(ManualClock::new(START));
    let mut p = policy();
    p.mode = spendgate_core::ReservationMode::WholeRun;
    p.run.max_cost = spendgate_core::Micros(1_000_000);
    let store = open_with(&server, clock.clone(), p).await;
    let s: Arc<dyn Store> = store.clone();
    for i in 0..4 {
        let run = format!("w{i}");
        admit(&s, who(i).run(&run)).await;
        reserve(&s, model_step(&run, &format!("{run}-m"), 100, Some(50))).await;
        resolve(&s, &format!("{run}-m"), tokens(90, 40)).await;
        reserve(&s, micros_step(&run, &format!("{run}-t"), 300)).await;
        if i.is_multiple_of(2) {
            resolve(&s, &format!("{run}-t"), units(200)).await;
            finish(&s, &run).await;
        }
    }
    // two runs' leases run out: their holds are charged in full
    clock.advance_ms(31_000);
    cs::sweep(&s).await;
    let pg = Arc::new(PgHistory::new(&pgs.url()));
    let d = Drain::new(
        store.clone(),
        Some(pg.clone() as Arc<dyn HistorySink>),
        "r1".into(),
    );
    drain_all(&d, 100).await;
    check_sums(&s, &pg).await;
    let period = HistoryFilter::period(UnixMs(0), UnixMs(u64::MAX / 2));
    let holds: BTreeMap<String, u64> = pg
        .reservations(&period, None, 10_000)
        .await
        .expect("read")
        .items
        .into_iter()
        .filter(|r| r.class == spendgate_core::history::StepClass::RunHold)
        .map(|r| (r.run_id.0, r.charged.0))
        .collect();
    assert_eq!(holds.len(), 4);
    let runs = pg.runs(&period, None, 100).await.expect("runs").items;
    assert_eq!(runs.len(), 4);
    for r in &runs {
        assert_eq!(
            r.cost.0, holds[&r.id.0],
            "run {}: cost is its hold's charge",
            r.id.0
        );
        if r.ended == spendgate_core::RunState::Expired {
            assert_eq!(
                r.cost.0, 1_000_000,
                "an expired run's hold is charged in full"
            );
        } else {
            assert!(r.cost.0 < 1_000_000);
        }
    }
}
