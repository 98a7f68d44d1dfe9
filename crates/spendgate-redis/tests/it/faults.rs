//! Redis failing in the ways a ledger must survive: paused (SIGSTOP), killed, restarted with
//! and without its AOF, script cache flushed, evicting, rolled back; plus double commits and
//! many replicas hammering one budget on the server's clock.

use crate::support::*;
use spendgate_core::*;
use spendgate_redis::{
    IdentityError, InitMode, Initialised, RedisOptions, RedisStore, RollbackConsent,
};
use spendgate_store::{Store, StoreError};
use std::sync::Arc;
use std::time::{Duration, Instant};

const BUDGET: u64 = 1_000_000;
const TOOL: u64 = 10_000;

/// Global budget 1.00 a day, nothing else limited; tool steps of 0.01.
fn policy() -> Policy {
    Policy {
        global: ScopePolicy {
            budgets: vec![Budget::new(Micros(BUDGET), Window::Day)],
            rate: None,
            concurrency: None,
            dry_run: false,
            rate_dry_run: false,
            concurrency_dry_run: false,
        },
        ip: ScopePolicy::default(),
        session: ScopePolicy::default(),
        conversation: ScopePolicy::default(),
        run: RunBounds {
            max_tool_calls: 1000,
            max_cost: Micros(BUDGET),
            ..RunBounds::default()
        },
        mode: ReservationMode::PerStep,
        lease_ttl_ms: 30_000,
        session_create_per_ip: None,
        session_create_global: None,
    }
}

fn run_req(id: &str) -> RunRequest {
    RunRequest {
        run_id: RunId(id.into()),
        session: "s".into(),
        ips: vec![IpScope {
            prefix: "192.0.2.1/32".into(),
            factor: 1,
        }],
        conversation: format!("c-{id}"),
        input_bytes: 10,
    }
}

fn store_of(s: &RedisStore) -> &dyn Store {
    s
}

async fn admit(s: &dyn Store, id: &str) {
    let a = s.admit_run(run_req(id), None).await.expect("admit");
    a.value.expect("admitted");
}

async fn reserve(s: &dyn Store, run: &str, step: &str) -> Result<StepReserved, Refusal> {
    s.reserve_step(tool_step(run, step, TOOL), None)
        .await
        .expect("reserve")
        .value
}

async fn global_usage(s: &dyn Store) -> (u64, u64) {
    let lines = s.usage(vec![(ScopeKey::global(), 1)]).await.expect("usage");
    (lines[0].used.0, lines[0].reserved.0)
}

fn server_opts(server: &spendgate_testkit::RedisServer, timeout: Duration) -> RedisOptions {
    RedisOptions {
        timeout,
        ..options(server, &fresh_prefix("fault"), None)
    }
}

/// Waits until `f` succeeds, at most `within`; returns how long it took.
async fn eventually<F, Fut, T>(within: Duration, mut f: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    let start = Instant::now();
    loop {
        match f().await {
            Ok(_) => return start.elapsed(),
            Err(e) if start.elapsed() < within => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("still failing after {within:?}: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_redis_fails_fast_and_service_resumes_without_reopening() {
    let server = server(false);
    let timeout = Duration::from_millis(200);
    let store = open(server_opts(&server, timeout), policy()).await;
    let s = store_of(&store);
    store.ready().await.expect("ready");
    admit(s, "r1").await;
    reserve(s, "r1", "x1").await.expect("reserved");

    server.pause().expect("SIGSTOP");
    for cmd in [
        Command::AdmitRun {
            req: run_req("r2"),
            idem: None,
        },
        Command::ReserveStep {
            req: tool_step("r1", "x2", TOOL),
            idem: None,
        },
        Command::Resolve {
            step: ReservationId("x1".into()),
            how: Resolution::Commit(Settlement::Units(0)),
        },
        Command::Summary,
    ] {
        let start = Instant::now();
        let r = s.execute(cmd).await;
        let took = start.elapsed();
        assert!(
            matches!(r, Err(ref e) if e.is_unavailable()),
            "nothing is answered while Redis is paused: {r:?}"
        );
        assert!(
            took < timeout + Duration::from_millis(50),
            "answered unavailable after {took:?}, timeout is {timeout:?}"
        );
    }
    let start = Instant::now();
    assert!(store.ready().await.is_err(), "not ready while paused");
    assert!(start.elapsed() < timeout + Duration::from_millis(50));

    server.resume().expect("SIGCONT");
    let took = eventually(Duration::from_secs(2), || s.summary()).await;
    println!("service resumed {took:?} after SIGCONT");
    store.ready().await.expect("ready again");
    // Scripts sent while paused may have run late, once Redis resumed (their answers were
    // lost): the admission of r2, the hold x2 (held like any reservation of unknown outcome)
    // and the commit of x1. Nothing else changed: x1 is held or committed at its price, the
    // only other reservation can be x2, held, and the totals are exactly theirs.
    let rows = s.reservations(None, 100).await.expect("reservations");
    let x1 = rows.iter().find(|r| r.id.0 == "x1").expect("x1 is kept");
    println!("after resume: x1 {:?}, rows {}", x1.state, rows.len());
    for r in &rows {
        assert_eq!(r.amount, Micros(TOOL), "{r:?}");
        match r.id.0.as_str() {
            "x1" => assert!(
                matches!(
                    (r.state, r.charged),
                    (ReservationState::Held, Micros(0))
                        | (ReservationState::Committed, Micros(TOOL))
                ),
                "{r:?}"
            ),
            "x2" => assert_eq!((r.state, r.charged), (ReservationState::Held, Micros(0))),
            other => panic!("reservation {other} appeared: {r:?}"),
        }
    }
    let charged: u64 = rows.iter().map(|r| r.charged.0).sum();
    let held = rows
        .iter()
        .filter(|r| r.state == ReservationState::Held)
        .count() as u64;
    assert_eq!(global_usage(s).await, (charged, held * TOOL));
    // The caller retries the commit whose answer it never had: it applies exactly once.
    let was_held = x1.state == ReservationState::Held;
    let c = s
        .resolve(
            ReservationId("x1".into()),
            Resolution::Commit(Settlement::Units(0)),
        )
        .await
        .expect("commit retried after resume");
    assert_eq!(
        (c.value.state, c.value.charged, c.value.repeated),
        (ReservationState::Committed, Micros(TOOL), !was_held),
        "the retry applies the commit unless it ran late, never twice"
    );
    let again = s
        .resolve(
            ReservationId("x1".into()),
            Resolution::Commit(Settlement::Units(0)),
        )
        .await
        .expect("commit repeated");
    assert!(again.value.repeated);
    let (used, reserved) = global_usage(s).await;
    assert_eq!(used, TOOL, "x1 charged once");
    assert_eq!(reserved, (held - u64::from(was_held)) * TOOL);
    reserve(s, "r1", "x3").await.expect("reserved after resume");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_redis_answers_unavailable_and_aof_restart_keeps_usage_and_holds() {
    let mut server = server(true);
    let store = open(server_opts(&server, Duration::from_secs(2)), policy()).await;
    let s = store_of(&store);
    admit(s, "r1").await;
    reserve(s, "r1", "held").await.expect("reserved");
    reserve(s, "r1", "done").await.expect("reserved");
    s.resolve(
        ReservationId("done".into()),
        Resolution::Commit(Settlement::Units(0)),
    )
    .await
    .expect("commit");
    let before = global_usage(s).await;
    assert_eq!(before, (TOOL, TOOL));
    let seq = s.summary().await.expect("summary").seq;

    server.stop().expect("SIGKILL");
    let r = s.execute(Command::Summary).await;
    assert!(matches!(r, Err(ref e) if e.is_unavailable()), "{r:?}");
    let r = s.admit_run(run_req("r2"), None).await;
    assert!(matches!(r, Err(ref e) if e.is_unavailable()), "{r:?}");
    // The commit of a held step cannot reach Redis: it fails, and nothing is applied.
    let r = s
        .resolve(
            ReservationId("held".into()),
            Resolution::Commit(Settlement::Units(0)),
        )
        .await;
    assert!(matches!(r, Err(ref e) if e.is_unavailable()), "{r:?}");
    assert!(store.ready().await.is_err());

    server.restart().expect("restart with AOF");
    eventually(Duration::from_secs(3), || store.ready()).await;
    assert_eq!(global_usage(s).await, before, "usage and holds survive");
    let held = s
        .reservations(Some(ReservationState::Held), 10)
        .await
        .expect("reservations");
    assert_eq!(held.len(), 1);
    assert_eq!(held[0].id.0, "held");
    assert_eq!(
        held[0].charged,
        Micros::ZERO,
        "the failed commit charged nothing"
    );
    assert!(s.summary().await.expect("summary").seq >= seq);
    // And the held reservation can still be committed, once.
    let c = s
        .resolve(
            ReservationId("held".into()),
            Resolution::Commit(Settlement::Units(0)),
        )
        .await
        .expect("commit after restart");
    assert_eq!(
        (c.value.state, c.value.charged, c.value.repeated),
        (ReservationState::Committed, Micros(TOOL), false)
    );
    assert_eq!(global_usage(s).await, (2 * TOOL, 0));
    let again = s
        .resolve(
            ReservationId("held".into()),
            Resolution::Commit(Settlement::Units(0)),
        )
        .await
        .expect("commit repeated");
    assert!(again.value.repeated);
    assert_eq!(global_usage(s).await, (2 * TOOL, 0), "charged once");
}

/// Redis came back empty: every store refuses, a new one too, and no routine operator command
/// reopens it (`store init` and `store accept-reset` refuse where the pinned ledger is lost);
/// only a new ledger, said in so many words, starts there, under a new id that the stores
/// pinned to the old one keep refusing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_back_empty_stays_closed_and_only_a_new_ledger_starts_there() {
    let mut server = server(false);
    let opts = server_opts(&server, Duration::from_secs(2));
    let store = open(opts.clone(), policy()).await;
    let s = store_of(&store);
    admit(s, "r1").await;
    reserve(s, "r1", "x1").await.expect("reserved");

    server.stop().expect("SIGKILL");
    server
        .restart()
        .expect("restart without persistence: empty");
    // Every call refuses, reads included: the ledger Redis holds is not the one we knew.
    let wait = Instant::now();
    loop {
        let r = s.admit_run(run_req("r2"), None).await;
        match r {
            Err(StoreError::Unavailable(msg)) if msg.contains("no ledger") => break,
            Err(e) if e.is_unavailable() && wait.elapsed() < Duration::from_secs(3) => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            other => panic!("expected the lost-ledger refusal, got {other:?}"),
        }
    }
    assert!(matches!(s.summary().await, Err(StoreError::Unavailable(_))));
    assert!(store.ready().await.is_err());
    // A replica starting now (a deploy, a crash, autoscaling) must not initialise over the
    // loss either: an empty prefix looks new, and only `spendgate store init` creates a ledger.
    let other = open_only(opts.clone(), policy()).await;
    let r = store_of(&other).admit_run(run_req("r3"), None).await;
    assert!(
        matches!(r, Err(StoreError::Unavailable(ref m)) if m.contains("no ledger")),
        "a replica started on an emptied Redis refuses: {r:?}"
    );
    assert!(other.ready().await.is_err());

    // The routine commands, run with the pinned config, refuse and change nothing.
    let pinned = with_pin(opts.clone());
    let old = pinned.ledger_id.clone().expect("a pin");
    for _ in 0..2 {
        let r = RedisStore::init(&pinned, InitMode::Routine).await;
        assert!(matches!(r, Err(IdentityError::Lost { .. })), "{r:?}");
        for consent in [RollbackConsent::NotGiven, RollbackConsent::Given] {
            let r = RedisStore::accept_reset(&pinned, consent).await;
            assert!(matches!(r, Err(IdentityError::Lost { .. })), "{r:?}");
        }
    }
    assert_eq!(server.command(&["DBSIZE"]).expect("DBSIZE"), "0");
    assert!(s.admit_run(run_req("r4"), None).await.is_err());
    assert!(store_of(&other)
        .admit_run(run_req("r4b"), None)
        .await
        .is_err());

    // Said in so many words: a new ledger, under a new id.
    let done = RedisStore::init(&pinned, InitMode::NewLedger)
        .await
        .expect("a new ledger");
    let new = match &done {
        Initialised::Created {
            ledger,
            kept_data: false,
        } => ledger.clone(),
        other => panic!("{other:?}"),
    };
    assert_ne!(new, old, "never the pinned id");
    // Stores pinned to the old ledger keep refusing, running or new.
    for st in [s, store_of(&other)] {
        let r = st.admit_run(run_req("r5"), None).await;
        assert!(
            matches!(r, Err(StoreError::Unavailable(ref m)) if m.contains(&new)),
            "{r:?}"
        );
    }
    let late = open_only(opts.clone(), policy()).await;
    assert!(late.ready().await.is_err());
    // One pinned to the new ledger admits, from zero.
    let renewed = RedisOptions {
        ledger_id: Some(new.clone()),
        ..opts.clone()
    };
    let fresh = open_only(renewed, policy()).await;
    fresh.ready().await.expect("ready on the new ledger");
    admit(store_of(&fresh), "r6").await;
    assert_eq!(global_usage(store_of(&fresh)).await, (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_ledger_is_refused_until_accepted() {
    let server = server(false);
    let opts = server_opts(&server, Duration::from_secs(2));
    let store = open(opts.clone(), policy()).await;
    let s = store_of(&store);
    let meta = format!("{{{}}}:meta", opts.prefix);
    let old = format!("{{{}}}:meta-old", opts.prefix);
    let newer = format!("{{{}}}:meta-newer", opts.prefix);
    admit(s, "r1").await;
    // (a copy of the ledger's meta, ledger_seq included, as a snapshot would hold it)
    server
        .command(&["COPY", &meta, &old, "REPLACE"])
        .expect("COPY");
    reserve(s, "r1", "x1").await.expect("reserved");
    reserve(s, "r1", "x2").await.expect("reserved");
    server
        .command(&["COPY", &meta, &newer, "REPLACE"])
        .expect("COPY");
    // As if Redis came back from an older snapshot: the ledger_seq went back.
    server
        .command(&["COPY", &old, &meta, "REPLACE"])
        .expect("COPY");
    let r = s.admit_run(run_req("r2"), None).await;
    assert!(
        matches!(r, Err(StoreError::Unavailable(ref m)) if m.contains("rolled back")),
        "{r:?}"
    );
    // Marked in Redis: a replica that never saw the higher seq (started now) refuses too.
    let other = open_only(opts.clone(), policy()).await;
    let r = store_of(&other).admit_run(run_req("r2b"), None).await;
    assert!(
        matches!(r, Err(StoreError::Unavailable(ref m)) if m.contains("rolled back")),
        "{r:?}"
    );
    // Latched: even after other writers push the seq up again.
    server
        .command(&["COPY", &newer, &meta, "REPLACE"])
        .expect("COPY");
    assert!(s.summary().await.is_err());
    // Without the operator's consent, a reset only says what it found.
    let pinned = with_pin(opts.clone());
    let r = RedisStore::accept_reset(&pinned, RollbackConsent::NotGiven).await;
    assert!(
        matches!(r, Err(IdentityError::RollbackNotAccepted { .. })),
        "{r:?}"
    );
    assert!(s.summary().await.is_err());
    let seq = RedisStore::accept_reset(&pinned, RollbackConsent::Given)
        .await
        .expect("accept reset");
    assert!(seq > 0, "the rolled-back ledger is kept, with its sequence");
    admit(s, "r3").await;
    admit(store_of(&other), "r3b").await;
}

/// An accepted reset is adopted only when it is newer than the epoch a replica knows: a Redis
/// restored from a backup that holds an older accepted reset stays closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_accepted_reset_is_not_adopted() {
    let server = server(false);
    let opts = server_opts(&server, Duration::from_secs(2));
    let store = open(opts.clone(), policy()).await;
    let pinned = with_pin(opts.clone());
    let reset = || RedisStore::accept_reset(&pinned, RollbackConsent::Given);
    let s = store_of(&store);
    let meta = format!("{{{}}}:meta", opts.prefix);
    let backup = format!("{{{}}}:meta-backup", opts.prefix);
    admit(s, "r1").await;
    reset().await.expect("first reset");
    admit(s, "r2").await;
    server
        .command(&["COPY", &meta, &backup, "REPLACE"])
        .expect("COPY");
    // (epoch times are milliseconds of the Redis clock)
    tokio::time::sleep(Duration::from_millis(5)).await;
    reset().await.expect("second reset");
    admit(s, "r3").await;
    server
        .command(&["COPY", &backup, &meta, "REPLACE"])
        .expect("COPY");
    let r = s.admit_run(run_req("r4"), None).await;
    assert!(
        matches!(r, Err(StoreError::Unavailable(ref m)) if m.contains("older")),
        "{r:?}"
    );
    reset().await.expect("third reset");
    admit(s, "r5").await;
}

/// Data written by a build with another stored layout is refused, not misread; a reset does
/// not paper over it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ledger_of_another_data_layout_is_refused() {
    let server = server(false);
    let opts = server_opts(&server, Duration::from_secs(2));
    let meta = format!("{{{}}}:meta", opts.prefix);
    // As an older build left it: an epoch without this build's layout tag.
    server
        .command(&[
            "HSET",
            &meta,
            "epoch",
            "0123abcd",
            "epoch_kind",
            "init",
            "seq",
            "7",
        ])
        .expect("HSET");
    fn layout<T>(r: &Result<T, IdentityError>) -> bool {
        matches!(r, Err(IdentityError::Store(StoreError::Unavailable(ref m))) if m.contains("data layout"))
    }
    let r = RedisStore::init(&opts, InitMode::Routine).await;
    assert!(layout(&r), "{r:?}");
    let r = RedisStore::init(&opts, InitMode::NewLedger).await;
    assert!(layout(&r), "{r:?}");
    let pinned = RedisOptions {
        ledger_id: Some(PIN.into()),
        ..opts.clone()
    };
    let store = open_only(pinned.clone(), policy()).await;
    let s = store_of(&store);
    let r = s.admit_run(run_req("r1"), None).await;
    assert!(
        matches!(r, Err(StoreError::Unavailable(ref m)) if m.contains("data layout")),
        "{r:?}"
    );
    assert!(store.ready().await.is_err());
    let r = RedisStore::accept_reset(&pinned, RollbackConsent::Given).await;
    assert!(layout(&r), "{r:?}");
    assert!(s.admit_run(run_req("r2"), None).await.is_err());
    // A deployment under a new prefix starts clean.
    let mut fresh = opts.clone();
    fresh.prefix = format!("{}-new", opts.prefix);
    let other = open(fresh, policy()).await;
    admit(store_of(&other), "r3").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_cache_flush_is_survived() {
    let server = server(false);
    let opts = server_opts(&server, Duration::from_secs(2));
    let store = open(opts.clone(), policy()).await;
    let s = store_of(&store);
    admit(s, "r1").await;
    for flush in [["SCRIPT", "FLUSH"], ["FUNCTION", "FLUSH"]] {
        server.command(&flush).expect("flush");
    }
    reserve(s, "r1", "x1")
        .await
        .expect("function not found: loaded and run once");
    assert_eq!(global_usage(s).await, (0, TOOL), "reserved exactly once");
    server
        .command(&["FUNCTION", "FLUSH"])
        .expect("FUNCTION FLUSH");
    assert_eq!(
        global_usage(s).await,
        (0, TOOL),
        "the read function reloads too"
    );
    // A second store (another replica) finds the library loaded; loading it again is harmless.
    let other = open(opts, policy()).await;
    server
        .command(&["FUNCTION", "FLUSH"])
        .expect("FUNCTION FLUSH");
    let (a, b) = tokio::join!(
        reserve(store_of(&other), "r1", "x2"),
        reserve(s, "r1", "x3")
    );
    a.expect("reserved");
    b.expect("reserved");
    assert_eq!(global_usage(s).await, (0, 3 * TOOL));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicting_redis_is_not_ready_and_admits_nothing() {
    let server = spendgate_testkit::RedisServer::start(spendgate_testkit::RedisOptions {
        maxmemory_policy: Some("allkeys-lru".into()),
        ..Default::default()
    })
    .expect("start redis-server");
    let store = open(server_opts(&server, Duration::from_secs(2)), policy()).await;
    let err = store.ready().await.expect_err("must not be ready");
    assert!(err.to_string().contains("maxmemory-policy"), "{err}");
    let r = store_of(&store).admit_run(run_req("r1"), None).await;
    assert!(matches!(r, Err(StoreError::Unavailable(_))), "{r:?}");

    // Fixed at runtime: ready again (admissions follow within the re-check interval).
    server
        .command(&["CONFIG", "SET", "maxmemory-policy", "noeviction"])
        .expect("CONFIG SET");
    store.ready().await.expect("ready once noeviction");
    admit(store_of(&store), "r2").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_that_arrives_twice_charges_once() {
    let server = server(false);
    let store = open(server_opts(&server, Duration::from_secs(2)), policy()).await;
    let s = store_of(&store);
    admit(s, "r1").await;
    reserve(s, "r1", "x1").await.expect("reserved");
    let how = Resolution::Commit(Settlement::Units(0));
    let first = s
        .resolve(ReservationId("x1".into()), how)
        .await
        .expect("commit");
    let second = s
        .resolve(ReservationId("x1".into()), how)
        .await
        .expect("commit again");
    assert!(!first.value.repeated && second.value.repeated);
    assert_eq!(first.value.charged, second.value.charged);
    assert_eq!(second.seq, first.seq, "a repeat changes nothing");
    assert_eq!(global_usage(s).await, (TOOL, 0));
    let r = s
        .resolve(ReservationId("x1".into()), Resolution::Release)
        .await;
    assert!(matches!(
        r,
        Err(StoreError::Ledger(LedgerError::Closed { .. }, _))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_tasks_on_four_replicas_grant_exactly_the_budget() {
    let server = server(false);
    let opts = server_opts(&server, Duration::from_secs(5));
    let mut replicas = Vec::new();
    for _ in 0..4 {
        let s: Arc<dyn Store> = Arc::new(open(opts.clone(), policy()).await);
        replicas.push(s);
    }
    // Every run is admitted first: once the budget is fully held, a run admitted later is
    // (rightly) refused, which is not what this test is about.
    for t in 0..16 {
        replicas[t % 4]
            .admit_run(run_req(&format!("run{t}")), None)
            .await
            .expect("admit")
            .value
            .expect("admitted");
    }
    let tasks = (0..16).map(|t| {
        let s = replicas[t % 4].clone();
        tokio::spawn(async move {
            let run = format!("run{t}");
            let mut granted = 0u64;
            for i in 0.. {
                match s
                    .reserve_step(tool_step(&run, &format!("{run}-{i}"), TOOL), None)
                    .await
                    .expect("reserve")
                    .value
                {
                    Ok(_) => granted += 1,
                    // (the steps are never resolved: their holds refuse, a wait)
                    Err(r) => {
                        assert_eq!(r.code, RefusalCode::BudgetHeld);
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
        granted,
        BUDGET / TOOL,
        "exactly the budget, across replicas"
    );
    assert_eq!(global_usage(replicas[0].as_ref()).await, (0, BUDGET));
    let seqs = replicas[1].summary().await.expect("summary").seq;
    assert_eq!(
        seqs,
        16 + BUDGET / TOOL,
        "one ledger_seq step per admission and grant"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_does_not_need_redis_and_service_starts_when_it_arrives() {
    let mut server = server(true);
    let opts = server_opts(&server, Duration::from_millis(300));
    let done = RedisStore::init(&opts, InitMode::Routine)
        .await
        .expect("init (kept by the AOF)");
    server.stop().expect("stop");
    let opts = RedisOptions {
        ledger_id: Some(done.ledger().to_string()),
        ..opts
    };
    let store = open_only(opts, policy()).await;
    assert!(store.ready().await.is_err(), "not ready without Redis");
    let start = Instant::now();
    let r = store_of(&store).admit_run(run_req("r1"), None).await;
    assert!(matches!(r, Err(ref e) if e.is_unavailable()), "{r:?}");
    assert!(start.elapsed() < Duration::from_millis(350));
    server.restart().expect("start");
    eventually(Duration::from_secs(2), || store.ready()).await;
    admit(store_of(&store), "r1").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_clock_is_the_one_clock() {
    let server = server(false);
    let store = open(server_opts(&server, Duration::from_secs(2)), policy()).await;
    let s = store_of(&store);
    let redis_now = server.command(&["TIME"]).expect("TIME");
    let secs: u64 = redis_now
        .lines()
        .next()
        .and_then(|l| l.parse().ok())
        .expect("TIME seconds");
    let a = s.admit_run(run_req("r1"), None).await.expect("admit");
    let deadline = a.value.expect("admitted").deadline;
    let created = deadline.0 - policy().run.max_seconds * 1000;
    assert!(
        created / 1000 >= secs && created / 1000 <= secs + 2,
        "run created at Redis time {created} (TIME said {secs})"
    );
    let lines = s.usage(vec![(ScopeKey::global(), 1)]).await.expect("usage");
    assert_eq!(lines[0].window, Window::Day.at(UnixMs(created)));
}

/// A TCP relay to Redis whose established connections can be frozen: their bytes stop
/// flowing both ways while the sockets stay open, as with a host gone without a reset or a
/// name moved to a new primary. New connections relay normally.
pub(crate) struct FreezingRelay {
    pub(crate) port: u16,
    frozen: Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl FreezingRelay {
    pub(crate) async fn start(to: u16) -> FreezingRelay {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind relay");
        let port = listener.local_addr().expect("relay address").port();
        let frozen = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let gen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (f, g) = (frozen.clone(), gen.clone());
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                // A connection made after a freeze is a new one: it relays.
                if f.swap(false, std::sync::atomic::Ordering::SeqCst) {
                    g.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
                let mine = g.load(std::sync::atomic::Ordering::SeqCst);
                let (f, g) = (f.clone(), g.clone());
                tokio::spawn(async move {
                    let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", to)).await else {
                        return;
                    };
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    let live = move || {
                        !f.load(std::sync::atomic::Ordering::SeqCst)
                            && g.load(std::sync::atomic::Ordering::SeqCst) == mine
                    };
                    let live2 = live.clone();
                    let up = relay(&mut cr, &mut sw, live);
                    let down = relay(&mut sr, &mut cw, live2);
                    let _ = tokio::join!(up, down);
                });
            }
        });
        FreezingRelay { port, frozen, task }
    }

    /// Freezes every connection open now.
    pub(crate) fn freeze(&self) {
        self.frozen.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for FreezingRelay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copies `from` to `to` while `live()`; once it is not, holds the bytes (never closes).
async fn relay(
    from: &mut tokio::net::tcp::OwnedReadHalf,
    to: &mut tokio::net::tcp::OwnedWriteHalf,
    live: impl Fn() -> bool,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        while !live() {
            tokio::time::sleep(Duration::from_secs(3600)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// A connection that stops answering without closing (half-open) is replaced: service
/// resumes within a few seconds, not when the kernel gives up on the socket many minutes
/// later. Meanwhile every call is refused within its timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_open_connection_is_replaced() {
    let server = server(false);
    let relay = FreezingRelay::start(server.port()).await;
    let mut opts = server_opts(&server, Duration::from_millis(300));
    opts.url = format!("redis://127.0.0.1:{}/0", relay.port);
    let store = open(opts, policy()).await;
    let s = store_of(&store);
    admit(s, "r1").await;
    relay.freeze();
    let start = Instant::now();
    let r = s.admit_run(run_req("r2"), None).await;
    assert!(matches!(r, Err(ref e) if e.is_unavailable()), "{r:?}");
    assert!(
        start.elapsed() < Duration::from_millis(400),
        "{:?}",
        start.elapsed()
    );
    let took = eventually(Duration::from_secs(5), || async {
        s.admit_run(run_req("r3"), None).await.map(|_| ())
    })
    .await;
    assert!(took < Duration::from_secs(5));
    store.ready().await.expect("ready on the new connection");
}

/// A Redis that is a replica of another is no ledger: never ready, nothing admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_node_is_never_ready() {
    let primary = server(false);
    let replica = server(false);
    let port = primary.port().to_string();
    replica
        .command(&["REPLICAOF", "127.0.0.1", &port])
        .expect("REPLICAOF");
    let opts = RedisOptions {
        ledger_id: Some(PIN.into()),
        ..server_opts(&replica, Duration::from_secs(2))
    };
    let store = open_only(opts, policy()).await;
    let r = store.ready().await;
    assert!(
        matches!(r, Err(StoreError::Unavailable(ref m)) if m.contains("not a primary")),
        "{r:?}"
    );
    let r = store_of(&store).admit_run(run_req("r1"), None).await;
    assert!(matches!(r, Err(ref e) if e.is_unavailable()), "{r:?}");
}
