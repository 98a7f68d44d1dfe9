//! Issue 18: replicas on one ledger with different limits each enforce their own on the
//! shared counters. Each publishes a fingerprint of its policy; a differing one is reported
//! in `/admin/v1/summary`, in `/metrics` and as an alert (once across replicas), within
//! seconds; replicas with equal configs report none.

use crate::alerts::{events, receiver};
use crate::harness::*;
use serde_json::Value;
use spendgate_testkit::{RedisOptions, RedisServer};
use std::time::{Duration, Instant};

/// Drift must be seen within this (the replicas publish every 3 s).
const WITHIN: Duration = Duration::from_secs(10);

fn config(budget: &str, webhook: &str) -> String {
    format!(
        r#"
[limits.global]
budgets = [{{ amount = "{budget}", window = "day" }}]

[tools.web_search]
per_call = "0.01"

[alerts]
webhook_url = "{webhook}"
"#
    )
}

/// Polls `s`'s summary until `done` holds of it (or `WITHIN` passed); the last summary.
async fn summary_until(s: &Server, done: impl Fn(&Value) -> bool) -> Value {
    let until = Instant::now() + WITHIN;
    loop {
        let v = s.admin_get("/admin/v1/summary").await;
        if done(&v) || Instant::now() > until {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn metric(text: &str, name: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_with_different_limits_are_reported_and_equal_ones_are_not() {
    let redis = RedisServer::start(RedisOptions::default()).expect("redis");
    let (hook, got, task) = receiver().await;

    // Two replicas on one ledger, one allowing 1.00 a day, the other 2.00.
    let a = Server::start_redis(&redis.url(), "drift", &config("1.00", &hook));
    let b = Server::start_redis_replica(&redis.url(), "drift", &config("2.00", &hook), &[]);
    let s = summary_until(&a, |v| v["policy_drift"] == true).await;
    assert_eq!(s["policy_drift"], true, "seen within {WITHIN:?}: {s}");
    let fps = s["policy"]["fingerprints"]
        .as_array()
        .expect("fingerprints");
    assert_eq!(fps.len(), 2, "{s}");
    assert!(fps.iter().all(|f| f["replicas"] == 1), "{s}");
    assert_eq!(s["policy"]["replicas"].as_array().map(Vec::len), Some(2));
    let own = s["policy"]["fingerprint"]
        .as_str()
        .expect("own")
        .to_string();
    assert!(fps.iter().any(|f| f["fingerprint"] == own.as_str()));
    // The other replica says the same; its metrics too.
    let sb = summary_until(&b, |v| v["policy_drift"] == true).await;
    assert_eq!(sb["policy_drift"], true, "{sb}");
    assert_ne!(sb["policy"]["fingerprint"], own.as_str());
    let m = b.metrics().await;
    assert_eq!(metric(&m, "spendgate_policy_drift"), Some(1), "{m}");
    assert_eq!(metric(&m, "spendgate_policy_fingerprints"), Some(2), "{m}");
    assert!(m.contains(&format!(
        "spendgate_policy_replicas{{fingerprint=\"{own}\"}} 1"
    )));
    // One alert, from one of the two, however many times they look (every 3 s).
    let until = Instant::now() + WITHIN;
    while events(&got, "policy_drift").is_empty() && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(7)).await;
    let alerts = events(&got, "policy_drift");
    assert_eq!(alerts.len(), 1, "once across replicas: {alerts:?}");
    assert_eq!(alerts[0]["fingerprints"].as_array().map(Vec::len), Some(2));

    // Two replicas with one config on another ledger: both live, no drift, no alert.
    let (hook2, got2, task2) = receiver().await;
    let c = Server::start_redis(&redis.url(), "same", &config("1.00", &hook2));
    let d = Server::start_redis_replica(&redis.url(), "same", &config("1.00", &hook2), &[]);
    let s = summary_until(&c, |v| {
        v["policy"]["replicas"].as_array().map(Vec::len) == Some(2)
    })
    .await;
    assert_eq!(
        s["policy"]["replicas"].as_array().map(Vec::len),
        Some(2),
        "{s}"
    );
    assert_eq!(s["policy_drift"], false, "{s}");
    assert_eq!(s["policy"]["fingerprints"][0]["replicas"], 2, "{s}");
    assert_eq!(
        s["policy"]["fingerprint"],
        own.as_str(),
        "the same config, the same fingerprint, in another process"
    );
    let m = d.metrics().await;
    assert_eq!(metric(&m, "spendgate_policy_drift"), Some(0), "{m}");
    assert_eq!(metric(&m, "spendgate_policy_fingerprints"), Some(1), "{m}");
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(events(&got2, "policy_drift").is_empty());
    drop((a, b, c, d));
    task.abort();
    task2.abort();
}
