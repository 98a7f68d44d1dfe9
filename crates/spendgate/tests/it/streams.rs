//! Issue 4: 1,000 concurrent streams through the proxy, with no lost frame and every one
//! reconciled: the books equal the mock upstream's own count, to the micro.

use crate::harness::*;
use futures::StreamExt;
use serde_json::{json, Value};
use spendgate_mock_upstream::{MockConfig, MockUpstream};
use std::time::Duration;

const STREAMS: usize = 1000;
const TOKENS: u64 = 24;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_thousand_concurrent_streams_lose_no_frame_and_all_reconcile() {
    // A paced mock, so that the streams really are open at the same time.
    let mock = MockUpstream::new(MockConfig {
        tokens_per_second: 40,
        chunk_tokens: 4,
        completion_tokens: TOKENS,
        ..MockConfig::default()
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let mock_port = listener.local_addr().expect("addr").port();
    let task = tokio::spawn(mock.clone().serve(listener));
    let server = Server::start(&format!(
        r#"
[limits.global]
rate = "100000/second"
burst = 100000
concurrency = 5000
budgets = [{{ amount = "100", window = "day" }}]

[limits.ip]
rate = "100000/second"
burst = 100000
concurrency = 5000
budgets = []

[limits.session]
rate = "100000/second"
burst = 100000
concurrency = 5000
budgets = []

[run]
max_output_tokens = 100

[models."m"]
upstream = "up"
input_per_million = "1.00"
output_per_million = "3.00"
tokenizer = "bytes"

[upstreams.up]
base_url = "http://127.0.0.1:{mock_port}/v1"
timeout_s = 30
"#
    ));
    let session = server.session().await;
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(STREAMS)
        .timeout(Duration::from_secs(60))
        .build()
        .expect("client");
    let url = server.url("/v1/chat/completions");
    let mut tasks = Vec::with_capacity(STREAMS);
    for i in 0..STREAMS {
        let (http, url, session) = (http.clone(), url.clone(), session.clone());
        tasks.push(tokio::spawn(async move {
            let r = http
                .post(url)
                .bearer_auth(SERVICE)
                .header("spendgate-session", session)
                .header("spendgate-client-ip", "10.8.0.1")
                .header("spendgate-conversation", format!("s{i}"))
                .json(&json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": format!("stream {i}")}]}))
                .send()
                .await
                .expect("send");
            assert_eq!(r.status().as_u16(), 200, "stream {i}");
            let mut body = r.bytes_stream();
            let mut text = Vec::new();
            while let Some(chunk) = body.next().await {
                text.extend_from_slice(&chunk.expect("chunk"));
            }
            let text = String::from_utf8(text).expect("utf8");
            let mut words = Vec::new();
            let mut done = false;
            for line in text.lines() {
                let Some(data) = line.strip_prefix("data: ") else { continue };
                if data == "[DONE]" {
                    done = true;
                    continue;
                }
                let v: Value = serde_json::from_str(data).expect("chunk json");
                if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
                    words.extend(c.split_whitespace().map(str::to_string));
                }
            }
            assert!(done, "stream {i} ended without [DONE]");
            // Every frame arrived, in order: tok0 .. tok{TOKENS-1}.
            let want: Vec<String> = (0..TOKENS).map(|k| format!("tok{k}")).collect();
            assert_eq!(words, want, "stream {i} lost or reordered a frame");
        }));
    }
    for t in tasks {
        t.await.expect("stream task");
    }
    // Every stream reconciled: committed at the mock's usage, nothing held or unknown.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let summary = server.admin_get("/admin/v1/summary").await;
    assert_eq!(
        summary["reservations"]["committed"], STREAMS as u64,
        "{summary}"
    );
    assert_eq!(summary["held_micros"], 0, "{summary}");
    assert!(
        summary["reservations"]
            .get("unknown")
            .is_none_or(|v| v == 0),
        "{summary}"
    );
    let stats = mock.stats();
    assert_eq!(stats.completed, STREAMS as u64);
    assert_eq!(stats.completion_tokens, STREAMS as u64 * TOKENS);
    // 1.00 per million prompt tokens is one micro a token, 3.00 per million completion
    // tokens three: every call's cost is whole, so the books equal the mock's count exactly.
    let expected = stats.prompt_tokens + 3 * stats.completion_tokens;
    assert_eq!(
        summary["charged_micros"].as_u64(),
        Some(expected),
        "{summary}"
    );
    task.abort();
}
