//! Finding 6 of issue 18 on a real redis-server: a Redis that is slow for a moment (paused
//! for less than the grace) is waited for, not refused; one that stops answering is refused at
//! `timeout_ms + slow_grace_ms` once, then at `timeout_ms` until it admits again. Both through
//! `Timed`, as the server wires it (`RedisOptions::slow_grace` = `Timed`'s grace).

use crate::support::*;
use spendgate_core::*;
use spendgate_redis::{InitMode, RedisOptions, RedisStore};
use spendgate_store::{Store, StoreError, Timed};
use std::sync::Arc;
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_millis(100);
const GRACE: Duration = Duration::from_millis(1000);
/// Generous for 2 shared cores: the bound is what matters, not the scheduler's promptness.
const MARGIN: Duration = Duration::from_millis(250);
const TOOL: u64 = 10_000;

fn policy() -> Policy {
    Policy {
        global: ScopePolicy {
            budgets: vec![Budget::new(Micros(1_000_000), Window::Day)],
            ..ScopePolicy::default()
        },
        run: RunBounds {
            max_tool_calls: 1000,
            max_cost: Micros(1_000_000),
            ..RunBounds::default()
        },
        lease_ttl_ms: 30_000,
        ..Policy::default()
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

/// A store on `server` with `TIMEOUT` and `GRACE`, wrapped as the server wraps it.
async fn timed_store(
    server: &spendgate_testkit::RedisServer,
) -> (Arc<Timed<RedisStore>>, Arc<dyn Store>) {
    timed_store_at(server, None).await
}

/// [`timed_store`], reaching Redis at `port` (a relay) when given.
async fn timed_store_at(
    server: &spendgate_testkit::RedisServer,
    port: Option<u16>,
) -> (Arc<Timed<RedisStore>>, Arc<dyn Store>) {
    // Initialised with the suite's generous timeout (loading the library takes a while on
    // busy cores), then opened as the server opens it.
    let mut generous = options(server, &fresh_prefix("grace"), None);
    if let Some(port) = port {
        generous.url = format!("redis://127.0.0.1:{port}/0");
    }
    let done = RedisStore::init(&generous, InitMode::Routine)
        .await
        .expect("init");
    let opts = RedisOptions {
        timeout: TIMEOUT,
        slow_grace: GRACE,
        ledger_id: Some(done.ledger().to_string()),
        ..generous
    };
    let store = Arc::new(open_only(opts, policy()).await);
    store.ready().await.expect("ready");
    let timed = Arc::new(Timed::with_grace(store, TIMEOUT, GRACE));
    let dyn_store: Arc<dyn Store> = timed.clone();
    (timed, dyn_store)
}

/// Redis stalls for 400 ms (paused, as one slow fsync of `appendfsync always` or a busy host
/// stalls it) while 8 reservations wait: all are served when it answers, none refused. With
/// `store.timeout_ms` alone (what main did) every one was refused at 100 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_slow_within_the_grace_is_waited_for() {
    let server = server(false);
    let (timed, s) = timed_store(&server).await;
    s.admit_run(run_req("r1"), None)
        .await
        .expect("admit")
        .value
        .expect("admitted");
    let stall = Duration::from_millis(400);
    server.pause().expect("SIGSTOP");
    let started = Instant::now();
    let calls: Vec<_> = (0..8)
        .map(|i| {
            let s = s.clone();
            tokio::spawn(async move {
                let r = s
                    .reserve_step(tool_step("r1", &format!("x{i}"), TOOL), None)
                    .await;
                (r, started.elapsed())
            })
        })
        .collect();
    tokio::time::sleep(stall).await;
    server.resume().expect("SIGCONT");
    for c in calls {
        let (r, took) = c.await.expect("join");
        let granted = r
            .unwrap_or_else(|e| panic!("refused after {took:?}: {e}"))
            .value;
        assert!(granted.is_ok(), "{granted:?}");
        assert!(
            took >= stall && took < TIMEOUT + GRACE,
            "answered after {took:?}"
        );
    }
    assert!(!timed.failing());
    let line = &s.usage(vec![(ScopeKey::global(), 1)]).await.expect("usage")[0];
    assert_eq!(line.reserved, Micros(8 * TOOL));
}

/// Redis stays paused: the first reservation is refused once the grace is spent (the store's
/// own call bound, 0.9 of `timeout + grace`, or `Timed`'s), and marks the store failing; the
/// next ones, reads too, and `ready()` are refused at `timeout`. After SIGCONT an admission is
/// served and closes the circuit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_redis_is_refused_at_the_timeout_once_known_to_fail() {
    let server = server(false);
    let (timed, s) = timed_store(&server).await;
    s.admit_run(run_req("r1"), None)
        .await
        .expect("admit")
        .value
        .expect("admitted");
    server.pause().expect("SIGSTOP");
    let start = Instant::now();
    let r = s.reserve_step(tool_step("r1", "first", TOOL), None).await;
    let took = start.elapsed();
    assert!(matches!(r, Err(StoreError::Timeout(_))), "{r:?}");
    let bound = TIMEOUT + GRACE;
    assert!(
        took >= bound - bound / 10 && took < bound + MARGIN,
        "the first call waited {took:?}; its bound is {bound:?}"
    );
    assert!(timed.failing(), "not answering within the grace: failing");
    let mut times = Vec::new();
    for i in 0..10 {
        let start = Instant::now();
        let r = s
            .reserve_step(tool_step("r1", &format!("later{i}"), TOOL), None)
            .await;
        times.push(start.elapsed());
        assert_eq!(r.map(|_| ()), Err(StoreError::Timeout(TIMEOUT)));
        let start = Instant::now();
        let r = s.execute(Command::Summary).await;
        times.push(start.elapsed());
        assert_eq!(r.map(|_| ()), Err(StoreError::Timeout(TIMEOUT)));
    }
    let start = Instant::now();
    assert_eq!(s.ready().await, Err(StoreError::Timeout(TIMEOUT)));
    times.push(start.elapsed());
    let mut sorted = times.clone();
    sorted.sort();
    println!(
        "paused redis (timeout {TIMEOUT:?}, grace {GRACE:?}): first call refused after \
         {took:?}; then p50 {:?}, max {:?} over {} calls",
        sorted[sorted.len() / 2],
        sorted[sorted.len() - 1],
        sorted.len()
    );
    for took in &times {
        assert!(
            *took >= TIMEOUT && *took < TIMEOUT + MARGIN,
            "refused after {took:?} while known failing; timeout is {TIMEOUT:?}"
        );
    }
    server.resume().expect("SIGCONT");
    let until = Instant::now() + Duration::from_secs(3);
    loop {
        match s.admit_run(run_req("r2"), None).await {
            Ok(a) => {
                a.value.expect("admitted");
                break;
            }
            Err(e) => assert!(Instant::now() < until, "not served 3 s after SIGCONT: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!timed.failing(), "an admission answered closes the circuit");
    s.ready().await.expect("ready again");
}

/// A half-open connection (frozen by a relay) while Redis is paused, so the check of a new
/// connection made when the first call ran out of grace finds no primary and keeps the frozen
/// one. Redis resumes: the calls refused at `timeout_ms` meanwhile (their callers abandon
/// them: `Timed` cuts them) still have the connection checked, so service resumes within a
/// few seconds, before `Timed`'s next probe (5 s after the circuit opened) would find it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_open_connection_is_replaced_while_calls_are_cut_at_the_timeout() {
    let server = server(false);
    let relay = crate::faults::FreezingRelay::start(server.port()).await;
    let (timed, s) = timed_store_at(&server, Some(relay.port)).await;
    s.admit_run(run_req("r1"), None)
        .await
        .expect("admit")
        .value
        .expect("admitted");
    server.pause().expect("SIGSTOP");
    relay.freeze();
    let r = s.admit_run(run_req("r2"), None).await;
    assert!(matches!(r, Err(StoreError::Timeout(_))), "{r:?}");
    let opened = Instant::now();
    assert!(timed.failing());
    // The check of a new connection that the first call's timeout started waits up to
    // timeout + grace for a paused Redis: resume after it gave up.
    tokio::time::sleep(TIMEOUT + GRACE + Duration::from_millis(300)).await;
    server.resume().expect("SIGCONT");
    let until = opened + spendgate_store::PROBE_EVERY - Duration::from_millis(500);
    let mut refused = 0;
    loop {
        let start = Instant::now();
        match s.admit_run(run_req("r3"), None).await {
            Ok(a) => {
                a.value.expect("admitted");
                break;
            }
            Err(e) => {
                refused += 1;
                assert!(
                    start.elapsed() < TIMEOUT + MARGIN,
                    "known failing: refused after {:?}",
                    start.elapsed()
                );
                assert!(
                    Instant::now() < until,
                    "still refused {:?} after the circuit opened ({refused} calls): {e}",
                    opened.elapsed()
                );
            }
        }
    }
    println!(
        "served again {:?} after the circuit opened, {refused} calls refused meanwhile",
        opened.elapsed()
    );
    assert!(!timed.failing());
}
