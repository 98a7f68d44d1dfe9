//! Alerts: a webhook POST when global spend crosses a threshold (once per threshold and
//! window), and on overruns.

use crate::harness::*;
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub(crate) async fn receiver() -> (String, Arc<Mutex<Vec<Value>>>, tokio::task::JoinHandle<()>) {
    let got = Arc::new(Mutex::new(Vec::new()));
    let sink = got.clone();
    let app = Router::new().route(
        "/hook",
        post(move |Json(v): Json<Value>| {
            let sink = sink.clone();
            async move {
                sink.lock().expect("lock").push(v);
                "ok"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}/hook", listener.local_addr().expect("addr"));
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (url, got, task)
}

pub(crate) fn events(got: &Arc<Mutex<Vec<Value>>>, kind: &str) -> Vec<Value> {
    got.lock()
        .expect("lock")
        .iter()
        .filter(|v| v["event"] == kind)
        .cloned()
        .collect()
}

/// Waits (up to 15 s) until an event of `kind` arrived.
pub(crate) async fn wait_for(got: &Arc<Mutex<Vec<Value>>>, kind: &str) {
    let until = Instant::now() + Duration::from_secs(15);
    while events(got, kind).is_empty() && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn threshold_alerts_fire_once_and_overruns_alert() {
    let (url, got, task) = receiver().await;
    let server = Server::start(&format!(
        r#"
[limits.global]
budgets = [{{ amount = "0.10", window = "day" }}]

[run]
max_tool_calls = 100

[tools.search]
per_call = "0.01"
per_unit = "0.01"

[alerts]
webhook_url = "{url}"
thresholds = [0.5, 1.0]
"#
    ));
    let s = server.session().await;
    let run = server.run(&s, "192.0.2.50", "alerts").await;
    // Three steps reserved at 0.02 (one unit), committed at 0.02: 0.06 of 0.10 = 60%.
    for _ in 0..3 {
        let step = server.tool_step(&run, "search").await;
        server.commit_units(&step, 1).await;
    }
    wait_for(&got, "threshold").await;
    let t = events(&got, "threshold");
    assert_eq!(t.len(), 1, "{t:?}");
    assert_eq!(t[0]["threshold"], 0.5);
    assert_eq!(t[0]["used_micros"], 60_000);
    assert!(
        t[0]["text"].as_str().is_some_and(|x| x.contains("50")),
        "Slack-compatible text: {t:?}"
    );

    // An overrun: reserved at one unit (0.02), committed at three (0.04).
    let step = server.tool_step(&run, "search").await;
    let (st, v) = server
        .post(&format!("/v1/steps/{step}/commit"), json!({"units": 3}))
        .await;
    assert_eq!((st, v["overrun"].as_bool()), (200, Some(true)), "{v}");
    wait_for(&got, "overrun").await;
    let o = events(&got, "overrun");
    assert_eq!(o.len(), 1, "{o:?}");
    assert_eq!(o[0]["step"], step.as_str());
    // 0.10 of 0.10 now: the 1.0 threshold fires once; 0.5 does not fire again.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let t = events(&got, "threshold");
    let thresholds: Vec<f64> = t.iter().filter_map(|v| v["threshold"].as_f64()).collect();
    assert_eq!(thresholds, vec![0.5, 1.0], "{t:?}");
    task.abort();
}

/// `alerts.scopes = ["ip"]`: an address prefix crossing a threshold of its own budget alerts
/// once, naming the prefix; the global budget, not listed, does not alert.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listed_scope_kind_alerts_per_scope() {
    let (url, got, task) = receiver().await;
    let server = Server::start(&format!(
        r#"
[limits.global]
budgets = [{{ amount = "0.05", window = "day" }}]

[limits.ip]
budgets = [{{ amount = "0.05", window = "day" }}]

[run]
max_tool_calls = 100

[tools.search]
per_call = "0.01"

[alerts]
webhook_url = "{url}"
thresholds = [0.5]
scopes = ["ip"]
"#
    ));
    let s = server.session().await;
    let run = server.run(&s, "192.0.2.60", "alerts-ip").await;
    // Three calls at 0.01: 0.03 of the address's 0.05 (60%), and of the global 0.05 too.
    for _ in 0..3 {
        let step = server.tool_step(&run, "search").await;
        server.commit_units(&step, 0).await;
    }
    wait_for(&got, "threshold").await;
    // Later checks must not send it again (scopes are checked every 10 s).
    tokio::time::sleep(Duration::from_millis(10_500)).await;
    let t = events(&got, "threshold");
    assert_eq!(t.len(), 1, "{t:?}");
    assert_eq!(t[0]["scope"], "ip");
    assert_eq!(t[0]["id"], "192.0.2.60/32");
    assert_eq!(t[0]["threshold"], 0.5);
    assert_eq!(t[0]["used_micros"], 30_000);
    assert_eq!(t[0]["limit_micros"], 50_000);
    task.abort();
}
