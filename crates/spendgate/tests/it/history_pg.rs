//! Issue 20: replicas on one Redis drain its usage history into their own PostgreSQL
//! (`[history] url`); one replica killed mid-load, the history still holds exactly one record
//! per reservation and per run, and the global budget's charges to the micro.

use crate::harness::*;
use spendgate_core::UnixMs;
use spendgate_history_pg::{totals, PgHistory};
use spendgate_store::{HistoryFilter, HistoryReader};
use spendgate_testkit::{PostgresServer, RedisOptions, RedisServer};
use std::time::{Duration, Instant};

/// Short leases (the `[store]` keys come first): unfinished runs end, and their records are
/// written, within seconds.
const CONFIG: &str = concat!(
    "lease_ttl_s = 2\ntimeout_ms = 500\n",
    tool_budget_config!("100.00", "")
);
/// How long the history may take to reach PostgreSQL: a killed replica's pending batch is
/// claimed after `spendgate_redis::history::CLAIM_IDLE` (30 s).
const DRAINED_WITHIN: Duration = Duration::from_secs(90);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_drain_the_history_into_postgres_once_even_when_one_is_killed() {
    let redis = RedisServer::start(RedisOptions::default()).expect("redis");
    let pgs = PostgresServer::start().unwrap_or_else(|e| panic!("a private PostgreSQL: {e}"));
    let extra = format!("{CONFIG}\n[history]\nurl = \"{}\"\n", pgs.url());
    let a = Server::start_redis(&redis.url(), "hist", &extra);
    let mut b = Server::start_redis(&redis.url(), "hist", &extra);
    let runs = 30;
    for i in 0..runs {
        let s = if i % 2 == 0 || i >= 20 { &a } else { &b };
        let session = s.session().await;
        let run = s
            .run(&session, &format!("10.2.0.{i}"), &format!("conv-{i}"))
            .await;
        let step = s.tool_step(&run, "web_search").await;
        s.commit_units(&step, 1).await;
        if i == 19 {
            // killed mid-load, its drain with it
            b.kill();
        }
    }
    let pg = PgHistory::new(&pgs.url());
    let period = HistoryFilter::period(UnixMs(0), UnixMs(u64::MAX / 2));
    let until = Instant::now() + DRAINED_WITHIN;
    let (reservations, ended) = loop {
        let r = pg.reservations(&period, None, 1_000).await;
        let u = pg.runs(&period, None, 1_000).await;
        if let (Ok(r), Ok(u)) = (&r, &u) {
            if r.items.len() >= runs && u.items.len() >= runs {
                break (r.items.clone(), u.items.clone());
            }
        }
        assert!(
            Instant::now() < until,
            "the history did not reach PostgreSQL: {:?} reservations, {:?} runs",
            r.map(|p| p.items.len()),
            u.map(|p| p.items.len())
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert_eq!(reservations.len(), runs, "one record per reservation");
    assert_eq!(ended.len(), runs, "one record per run");
    assert!(reservations.iter().all(|r| r.charged.0 == 10_000));
    let used = a.global_usage().await["used_micros"]
        .as_u64()
        .expect("used_micros");
    assert_eq!(used, 10_000 * runs as u64);
    let global: i64 = totals(&pg)
        .await
        .expect("totals")
        .into_iter()
        .filter(|(k, _)| k.starts_with("global:"))
        .map(|(_, v)| v)
        .sum();
    assert_eq!(
        global, used as i64,
        "the history's charges are the ledger's, to the micro"
    );
    // the drain's gauges, after its watch's first look
    tokio::time::sleep(Duration::from_secs(6)).await;
    let m = a.metrics().await;
    assert!(m.contains("spendgate_history_drain_lag_seconds "), "{m}");
    assert!(m.contains("spendgate_history_evicted_total 0"), "{m}");
}
