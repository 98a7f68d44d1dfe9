//! Issue 18, finding 7: a refusal caused by the holds of calls in flight is a wait, not a spent
//! budget. A burst of 200 one-call clients against a budget of 100 calls, each client retrying
//! as its refusal tells it (waits `Retry-After`, stops on `x-should-retry: false`), is served
//! exactly 100 calls within the holds' lease, never more; and no client is sent away to the
//! window's reset while the budget still had room.

use crate::harness::*;
use serde_json::json;
use spendgate_mock_upstream::{MockConfig, MockUpstream};
use spendgate_testkit::{RedisOptions, RedisServer};
use std::time::{Duration, Instant};

const MODEL: &str = "mock-model";
/// Clients in the burst, each with one call to make.
const CLIENTS: usize = 200;
/// Calls the budget covers.
const CALLS: u64 = 100;
/// A "hello" call's reservation at these prices (bytes bound: 16 prompt tokens × 10 + 100
/// output tokens × 30) and what the mock reports it cost (9 prompt tokens × 10 + 100 × 30):
/// the hold is above the charge, as in the finding (0.0115 held for 0.01 charged).
const HOLD: u64 = 3_160;
const CHARGE: u64 = 3_090;
/// A budget of exactly 100 calls: 99 charged and the 100th's hold fit; a 101st never does.
const BUDGET: u64 = (CALLS - 1) * CHARGE + HOLD;
/// `store.lease_ttl_s`: every hold resolves within it (each call takes `UPSTREAM_MS`).
const LEASE_TTL_S: u64 = 10;
const UPSTREAM_MS: u64 = 200;
/// Attempts one client makes at most (a bound on the loop; far above what it needs).
const ATTEMPTS_MAX: usize = 30;

/// `store_keys`: more `[store]` keys.
fn config(mock_port: u16, store_keys: &str) -> String {
    format!(
        r#"lease_ttl_s = {LEASE_TTL_S}
{store_keys}

[limits.global]
rate = "100000/second"
burst = 100000
concurrency = 10000
budgets = [{{ amount = "0.{BUDGET:06}", window = "day" }}]

[limits.ip]
rate = "100000/second"
burst = 100000
concurrency = 10000
budgets = []

[limits.session]
rate = "100000/second"
burst = 100000
concurrency = 10000
budgets = []

[limits.conversation]
concurrency = 1
budgets = []

[run]
max_context_tokens = 2000
max_output_tokens = 100
max_cost = "100"

[models."{MODEL}"]
upstream = "up"
input_per_million = "10"
cached_input_per_million = "10"
output_per_million = "30"
tokenizer = "bytes"

[upstreams.up]
base_url = "http://127.0.0.1:{mock_port}/v1"
api_key = "sk-upstream-test"
timeout_s = 30
"#
    )
}

/// The mock upstream, served from this test's runtime (its counters are the ground truth).
async fn mock() -> (MockUpstream, u16, tokio::task::JoinHandle<()>) {
    let mock = MockUpstream::new(MockConfig::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind mock");
    let port = listener.local_addr().expect("mock addr").port();
    let app = mock.router();
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (mock, port, task)
}

/// How one client's call ended.
#[derive(Debug)]
enum End {
    Served,
    /// Told not to retry: the refusal's code and `Retry-After`, and how many calls the
    /// upstream had completed when the client read it.
    SentAway {
        code: String,
        retry_after_s: u64,
        upstream_completed: u64,
    },
}

/// One client: its call, retried as each refusal says, until served or told not to retry.
async fn client(
    http: reqwest::Client,
    base: String,
    session: String,
    mock: MockUpstream,
    i: usize,
) -> End {
    let body = json!({"model": MODEL, "stream": i.is_multiple_of(2),
                      "messages": [{"role": "user", "content": "hello"}]});
    for _ in 0..ATTEMPTS_MAX {
        let r = http
            .post(format!("{base}/v1/chat/completions"))
            .bearer_auth(SERVICE)
            .header("spendgate-session", &session)
            .header("spendgate-client-ip", "10.1.2.3")
            .header("spendgate-conversation", format!("burst-{i}"))
            .header("x-mock-completion-tokens", "100")
            .header("x-mock-latency-ms", UPSTREAM_MS.to_string())
            .json(&body)
            .send()
            .await
            .expect("send");
        let status = r.status().as_u16();
        let header = |n: &str| {
            r.headers()
                .get(n)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let retry_after = header("retry-after").and_then(|v| v.parse::<u64>().ok());
        let should_retry = header("x-should-retry");
        let text = r.text().await.expect("body");
        if status == 200 {
            return End::Served;
        }
        assert_eq!(status, 429, "client {i}: {text}");
        let retry_after_s =
            retry_after.unwrap_or_else(|| panic!("client {i}: a 429 without Retry-After"));
        let v: serde_json::Value = serde_json::from_str(&text).expect("error JSON");
        let code = v["error"]["code"].as_str().unwrap_or("").to_string();
        if should_retry.as_deref() == Some("false") {
            return End::SentAway {
                code,
                retry_after_s,
                upstream_completed: mock.stats().completed,
            };
        }
        // A wait: a rate-limit type (OpenAI clients retry it), within the holds' lease.
        assert_eq!(
            (code.as_str(), v["error"]["type"].as_str()),
            ("budget_held", Some("rate_limit_error")),
            "client {i}: {text}"
        );
        assert!(
            (1..=LEASE_TTL_S).contains(&retry_after_s),
            "client {i}: Retry-After {retry_after_s} s is not within the lease"
        );
        tokio::time::sleep(Duration::from_secs(retry_after_s)).await;
    }
    panic!("client {i} was neither served nor sent away in {ATTEMPTS_MAX} attempts");
}

/// The burst against one gateway (`start` it on the mock's port); checks the acceptance.
async fn burst(store_keys: &str, start: impl FnOnce(&str) -> Server) {
    let (mock, port, task) = mock().await;
    let server = start(&config(port, store_keys));
    let session = server.session().await;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .pool_max_idle_per_host(CLIENTS)
        .build()
        .expect("client");
    let started = Instant::now();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|i| {
            tokio::spawn(client(
                http.clone(),
                server.url(""),
                session.clone(),
                mock.clone(),
                i,
            ))
        })
        .collect();
    let ends = tokio::time::timeout(Duration::from_secs(60), futures::future::join_all(clients))
        .await
        .expect("the burst ends in time");
    let elapsed = started.elapsed();
    let (mut served, mut sent_away) = (0u64, 0u64);
    for end in ends {
        match end.expect("client task") {
            End::Served => served += 1,
            End::SentAway {
                code,
                retry_after_s,
                upstream_completed,
            } => {
                assert_eq!(code, "budget_exhausted", "only a spent budget sends away");
                assert!(
                    retry_after_s > LEASE_TTL_S,
                    "a spent day budget waits for its reset, not {retry_after_s} s"
                );
                // The budget is spent only once the 100 calls it covers are charged, so a
                // client sent away before the upstream had served them all was sent away
                // from a budget that still had room (the finding: 114 of 200 were).
                assert_eq!(
                    upstream_completed, CALLS,
                    "a client was sent away to the window's reset while the budget had room"
                );
                sent_away += 1;
            }
        }
    }
    assert_eq!(
        (served, sent_away),
        (CALLS, CLIENTS as u64 - CALLS),
        "exactly the budget's 100 calls are served"
    );
    assert!(
        elapsed < Duration::from_secs(LEASE_TTL_S),
        "served within the holds' lease ({LEASE_TTL_S} s), took {elapsed:?}"
    );
    // The upstream's own count: 100 calls and no more reached it.
    let stats = mock.stats();
    assert_eq!((stats.requests, stats.completed), (CALLS, CALLS));
    let served_worth = stats.prompt_tokens * 10 + stats.completion_tokens * 30;
    assert_eq!(served_worth, CALLS * CHARGE);
    assert!(served_worth <= BUDGET);
    // The books: every hold resolved, the ground truth charged.
    let until = Instant::now() + Duration::from_secs(5);
    let global = loop {
        let g = server.global_usage().await;
        if g["reserved_micros"] == 0 || Instant::now() > until {
            break g;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        (
            global["used_micros"].as_u64(),
            global["reserved_micros"].as_u64()
        ),
        (Some(served_worth), Some(0)),
        "{global}"
    );
    drop(server);
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_burst_is_served_its_budget_when_clients_retry_as_told_sqlite() {
    burst("", Server::start).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_burst_is_served_its_budget_when_clients_retry_as_told_redis() {
    let redis = RedisServer::start(RedisOptions::default()).expect("redis");
    // (a store call may wait behind 200 others on two cores: not what this test is about)
    burst("timeout_ms = 2000", |config| {
        Server::start_redis(&redis.url(), "burst", config)
    })
    .await;
}
