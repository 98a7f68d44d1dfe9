//! Integration tests: a real mock on 127.0.0.1:0 driven by a real HTTP client.

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{json, Value};
use spendgate_mock_upstream::{prompt_tokens_of, MockConfig, MockStats, MockUpstream};

struct Mock {
    mock: MockUpstream,
    base: String,
    client: reqwest::Client,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Drop for Mock {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Mock {
    async fn start(config: MockConfig) -> Mock {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let mock = MockUpstream::new(config);
        let task = tokio::spawn(mock.clone().serve(listener));
        // reqwest is built with `rustls-no-provider` in this workspace: install one.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .expect("client");
        Mock {
            mock,
            base: format!("http://{addr}"),
            client,
            task,
        }
    }

    async fn default() -> Mock {
        Mock::start(MockConfig::default()).await
    }

    fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    fn chat(&self, body: &Value) -> reqwest::RequestBuilder {
        self.client
            .post(self.url("/v1/chat/completions"))
            .json(body)
    }

    async fn http_stats(&self) -> MockStats {
        self.client
            .get(self.url("/mock/stats"))
            .send()
            .await
            .expect("stats")
            .json()
            .await
            .expect("stats json")
    }
}

fn body(stream: bool) -> Value {
    json!({
        "model": "mock-model",
        "stream": stream,
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say something deterministic, please."}
        ]
    })
}

fn words(n: u64) -> String {
    (0..n)
        .map(|i| format!("tok{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The `data:` payloads of a whole SSE body.
fn events(text: &str) -> Vec<String> {
    text.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            e.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not an SSE data line: {e:?}"))
                .to_owned()
        })
        .collect()
}

fn json_events(events: &[String]) -> Vec<Value> {
    events
        .iter()
        .filter(|e| e.as_str() != "[DONE]")
        .map(|e| serde_json::from_str(e).expect("chunk json"))
        .collect()
}

/// Read a streaming response to its end or its error: (body text, whether it errored).
async fn read_stream(response: reqwest::Response) -> (String, bool) {
    let mut bytes = Vec::new();
    let mut stream = response.bytes_stream();
    let mut errored = false;
    while let Some(item) = stream.next().await {
        match item {
            Ok(b) => bytes.extend_from_slice(&b),
            Err(_) => {
                errored = true;
                break;
            }
        }
    }
    (String::from_utf8(bytes).expect("utf8"), errored)
}

fn content_of(chunks: &[Value]) -> String {
    chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect()
}

#[tokio::test]
async fn non_streaming_usage_and_stats() {
    let m = Mock::default().await;
    let req = body(false);
    let prompt = prompt_tokens_of(&req);
    // "You are terse." = 14 bytes -> 4; the user text = 36 bytes -> 9; +4 each, +3.
    assert_eq!(prompt, (4 + 4) + (9 + 4) + 3);

    let resp = m.chat(&req).send().await.expect("send");
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.expect("json");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "mock-model");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], words(16));
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        v["usage"],
        json!({
            "prompt_tokens": prompt,
            "completion_tokens": 16,
            "total_tokens": prompt + 16,
            "prompt_tokens_details": {"cached_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0}
        })
    );

    let stats = m.http_stats().await;
    assert_eq!(stats, m.mock.stats());
    assert_eq!(stats.requests, 1);
    assert_eq!(stats.completed, 1);
    assert_eq!(stats.prompt_tokens, prompt);
    assert_eq!(stats.completion_tokens, 16);
    assert_eq!(stats.cached_tokens, 0);
    assert_eq!(stats.by_fault.get("none"), Some(&1));
    assert_eq!(stats.max_tokens_seen, vec![0]);
    assert_eq!(stats.last_request, Some(req));
}

#[tokio::test]
async fn max_tokens_clamps_completion() {
    let m = Mock::default().await;
    let mut req = body(false);
    req["max_tokens"] = json!(9);
    req["max_completion_tokens"] = json!(5);
    let v: Value = m
        .chat(&req)
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_eq!(v["choices"][0]["message"]["content"], words(5));
    assert_eq!(v["choices"][0]["finish_reason"], "length");

    // Header-chosen length below max_tokens is not clamped.
    let mut req = body(false);
    req["max_tokens"] = json!(5);
    let v: Value = json_with(&m, &req, &[("x-mock-completion-tokens", "3")]).await;
    assert_eq!(v["usage"]["completion_tokens"], 3);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    // Streaming is clamped too.
    let mut req = body(true);
    req["max_completion_tokens"] = json!(6);
    req["stream_options"] = json!({"include_usage": true});
    let (text, errored) = read_stream(m.chat(&req).send().await.expect("send")).await;
    assert!(!errored);
    let chunks = json_events(&events(&text));
    assert_eq!(content_of(&chunks), words(6));
    let last = chunks.last().expect("usage chunk");
    assert_eq!(last["usage"]["completion_tokens"], 6);

    let stats = m.mock.stats();
    assert_eq!(stats.max_tokens_seen, vec![5, 5, 6]);
    assert_eq!(stats.completion_tokens, 5 + 3 + 6);
    assert_eq!(stats.completed, 3);
}

#[tokio::test]
async fn streaming_chunks_usage_and_done() {
    let m = Mock::default().await;
    let mut req = body(true);
    req["stream_options"] = json!({"include_usage": true});
    let prompt = prompt_tokens_of(&req);
    let resp = m.chat(&req).send().await.expect("send");
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["content-type"].to_str().expect("ct"),
        "text/event-stream"
    );
    let (text, errored) = read_stream(resp).await;
    assert!(!errored);
    assert!(text.ends_with("data: [DONE]\n\n"));
    let evs = events(&text);
    // 16 tokens / 4 per chunk = 4 content chunks, 1 finish chunk, 1 usage chunk, [DONE].
    assert_eq!(evs.len(), 7);
    assert_eq!(evs.last().map(String::as_str), Some("[DONE]"));
    let chunks = json_events(&evs);
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["id"], chunks[0]["id"]);
    }
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(
        chunks[0]["choices"][0]["delta"]["content"],
        "tok0 tok1 tok2 tok3"
    );
    assert_eq!(
        chunks[1]["choices"][0]["delta"]["content"],
        " tok4 tok5 tok6 tok7"
    );
    assert_eq!(content_of(&chunks), words(16));
    assert_eq!(chunks[4]["choices"][0]["finish_reason"], "stop");
    assert!(chunks[..5].iter().all(|c| c["usage"].is_null()));
    let usage_chunk = &chunks[5];
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(usage_chunk["usage"]["prompt_tokens"], prompt);
    assert_eq!(usage_chunk["usage"]["completion_tokens"], 16);
    assert_eq!(usage_chunk["usage"]["total_tokens"], prompt + 16);

    let stats = m.mock.stats();
    assert_eq!(stats.requests, 1);
    assert_eq!(stats.completed, 1);
    assert_eq!(stats.prompt_tokens, prompt);
    assert_eq!(stats.completion_tokens, 16);
}

#[tokio::test]
async fn streaming_without_include_usage_has_no_usage_chunk() {
    let m = Mock::default().await;
    let req = body(true);
    let (text, errored) = read_stream(m.chat(&req).send().await.expect("send")).await;
    assert!(!errored);
    let evs = events(&text);
    assert_eq!(evs.last().map(String::as_str), Some("[DONE]"));
    let chunks = json_events(&evs);
    assert_eq!(chunks.len(), 5); // 4 content + finish
    assert!(chunks.iter().all(|c| c.get("usage").is_none()));
    assert!(chunks
        .iter()
        .all(|c| c["choices"].as_array().is_some_and(|a| a.len() == 1)));
    assert_eq!(content_of(&chunks), words(16));
    // The mock still generated (and would bill) the tokens.
    let stats = m.mock.stats();
    assert_eq!(stats.prompt_tokens, prompt_tokens_of(&req));
    assert_eq!(stats.completion_tokens, 16);
    assert_eq!(stats.completed, 1);
}

#[tokio::test]
async fn streaming_is_paced_chunk_by_chunk() {
    // 12 tokens, 4 per chunk, 20 tokens/s: one chunk every 200 ms.
    let m = Mock::start(MockConfig {
        tokens_per_second: 20,
        completion_tokens: 12,
        ..MockConfig::default()
    })
    .await;
    let resp = m.chat(&body(true)).send().await.expect("send");
    let start = Instant::now();
    let mut stream = resp.bytes_stream();
    let mut arrivals = Vec::new();
    let mut text = String::new();
    while let Some(item) = stream.next().await {
        let b = item.expect("chunk");
        let s = String::from_utf8(b.to_vec()).expect("utf8");
        if s.contains("\"content\":\"") {
            arrivals.push(start.elapsed());
        }
        text.push_str(&s);
    }
    assert!(text.ends_with("data: [DONE]\n\n"));
    assert_eq!(content_of(&json_events(&events(&text))), words(12));
    // The content arrived spread over time, not in one buffered piece.
    assert!(arrivals.len() >= 2, "arrivals: {arrivals:?}");
    let spread = arrivals[arrivals.len() - 1] - arrivals[0];
    assert!(spread >= Duration::from_millis(250), "spread {spread:?}");
}

#[tokio::test]
async fn latency_header_delays_first_byte() {
    let m = Mock::default().await;
    let start = Instant::now();
    let resp = m
        .chat(&body(false))
        .header("x-mock-latency-ms", "200")
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 200);
    assert!(start.elapsed() >= Duration::from_millis(200));
}

#[tokio::test]
async fn http_429_fault_by_header() {
    let m = Mock::default().await;
    let resp = m
        .chat(&body(false))
        .header("x-mock-fault", "http_429")
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 429);
    assert_eq!(resp.headers()["retry-after"].to_str().expect("ra"), "1");
    let v: Value = resp.json().await.expect("json");
    assert!(v["error"]["message"].is_string());
    assert_eq!(v["error"]["type"], "rate_limit_error");
    assert_eq!(v["error"]["code"], "rate_limit_exceeded");
    let stats = m.mock.stats();
    assert_eq!(stats.requests, 1);
    assert_eq!(stats.completed, 0);
    assert_eq!(stats.prompt_tokens, 0);
    assert_eq!(stats.completion_tokens, 0);
    assert_eq!(stats.by_fault.get("http_429"), Some(&1));
}

#[tokio::test]
async fn http_500_fault_by_model_suffix() {
    let m = Mock::default().await;
    let mut req = body(true);
    req["model"] = json!("mock-model:http_500");
    let resp = m.chat(&req).send().await.expect("send");
    assert_eq!(resp.status(), 500);
    let v: Value = resp.json().await.expect("json");
    assert_eq!(v["error"]["type"], "server_error");
    assert!(v["error"]["message"].is_string());
    let stats = m.mock.stats();
    assert_eq!(stats.by_fault.get("http_500"), Some(&1));
    assert_eq!(stats.prompt_tokens, 0);
    assert_eq!(stats.completed, 0);
}

#[tokio::test]
async fn drop_mid_stream_streaming() {
    let m = Mock::default().await;
    let mut req = body(true);
    req["stream_options"] = json!({"include_usage": true});
    let resp = m
        .chat(&req)
        .header("x-mock-fault", "drop_mid_stream")
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 200);
    let (text, errored) = read_stream(resp).await;
    assert!(errored, "the stream must end in an error");
    assert!(!text.contains("[DONE]"));
    let chunks = json_events(&events(&text));
    assert_eq!(chunks.len(), 2);
    assert_eq!(content_of(&chunks), words(8));
    assert!(chunks.iter().all(|c| c["usage"].is_null()));
    let stats = m.mock.stats();
    assert_eq!(stats.by_fault.get("drop_mid_stream"), Some(&1));
    assert_eq!(stats.completed, 0);
    assert_eq!(stats.prompt_tokens, prompt_tokens_of(&req));
    assert_eq!(stats.completion_tokens, 8);
}

#[tokio::test]
async fn drop_mid_stream_non_streaming() {
    let m = Mock::default().await;
    let mut req = body(false);
    req["model"] = json!("mock-model:drop_mid_stream");
    let outcome = match m.chat(&req).send().await {
        Ok(resp) => resp.bytes().await.map(|_| ()),
        Err(e) => Err(e),
    };
    assert!(
        outcome.is_err(),
        "a dropped answer must not read as complete"
    );
    let stats = m.mock.stats();
    assert_eq!(stats.by_fault.get("drop_mid_stream"), Some(&1));
    assert_eq!(stats.completed, 0);
    assert_eq!(stats.prompt_tokens, prompt_tokens_of(&req));
    assert_eq!(stats.completion_tokens, 0);
}

#[tokio::test]
async fn hang_never_answers() {
    let m = Mock::default().await;
    let req = body(false);
    let start = Instant::now();
    let result = m
        .chat(&req)
        .header("x-mock-fault", "hang")
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    let err = result.expect_err("a hung request must not complete");
    assert!(err.is_timeout(), "expected a timeout, got {err:?}");
    assert!(start.elapsed() >= Duration::from_millis(300));
    let stats = m.mock.stats();
    assert_eq!(stats.by_fault.get("hang"), Some(&1));
    assert_eq!(stats.completed, 0);
    assert_eq!(stats.completion_tokens, 0);
    assert_eq!(stats.prompt_tokens, prompt_tokens_of(&req));
}

#[tokio::test]
async fn no_usage_fault() {
    let m = Mock::default().await;
    let mut req = body(true);
    req["stream_options"] = json!({"include_usage": true});
    let (text, errored) = read_stream(
        m.chat(&req)
            .header("x-mock-fault", "no_usage")
            .send()
            .await
            .expect("send"),
    )
    .await;
    assert!(!errored);
    let evs = events(&text);
    assert_eq!(evs.last().map(String::as_str), Some("[DONE]"));
    let chunks = json_events(&evs);
    assert!(chunks.iter().all(|c| c.get("usage").is_none()));
    assert!(chunks
        .iter()
        .all(|c| c["choices"].as_array().is_some_and(|a| !a.is_empty())));
    assert_eq!(content_of(&chunks), words(16));

    let v: Value = m
        .chat(&body(false))
        .header("x-mock-fault", "no_usage")
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    assert!(v.get("usage").is_none());
    assert_eq!(v["choices"][0]["message"]["content"], words(16));

    let stats = m.mock.stats();
    assert_eq!(stats.by_fault.get("no_usage"), Some(&2));
    assert_eq!(stats.completed, 2);
    assert_eq!(stats.completion_tokens, 32);
    assert_eq!(stats.prompt_tokens, prompt_tokens_of(&req) * 2);
}

#[tokio::test]
async fn usage_over_fault() {
    let m = Mock::default().await;
    let mut req = body(false);
    req["max_tokens"] = json!(5);
    let v: Value = json_with(&m, &req, &[("x-mock-fault", "usage_over")]).await;
    assert_eq!(v["usage"]["completion_tokens"], 15);
    assert_eq!(v["choices"][0]["message"]["content"], words(15));

    let mut req = body(true);
    req["max_tokens"] = json!(5);
    req["model"] = json!("mock-model:usage_over");
    req["stream_options"] = json!({"include_usage": true});
    let (text, errored) = read_stream(m.chat(&req).send().await.expect("send")).await;
    assert!(!errored);
    let chunks = json_events(&events(&text));
    assert_eq!(content_of(&chunks), words(15));
    assert_eq!(
        chunks.last().expect("usage")["usage"]["completion_tokens"],
        15
    );
    let stats = m.mock.stats();
    assert_eq!(stats.by_fault.get("usage_over"), Some(&2));
    assert_eq!(stats.completion_tokens, 30);
    assert_eq!(stats.max_tokens_seen, vec![5, 5]);
}

#[tokio::test]
async fn tool_call_fault() {
    let m = Mock::default().await;
    let v: Value = m
        .chat(&body(false))
        .header("x-mock-fault", "tool_call")
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert!(choice["message"]["content"].is_null());
    let calls = choice["message"]["tool_calls"].as_array().expect("calls");
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"]["name"], "web_search");
    let args: Value =
        serde_json::from_str(calls[0]["function"]["arguments"].as_str().expect("args"))
            .expect("args json");
    assert_eq!(args, json!({"q": words(16)}));
    assert_eq!(v["usage"]["completion_tokens"], 16);

    // Streaming: OpenAI delta form.
    let mut req = body(true);
    req["model"] = json!("mock-model:tool_call");
    req["stream_options"] = json!({"include_usage": true});
    let (text, errored) = read_stream(m.chat(&req).send().await.expect("send")).await;
    assert!(!errored);
    let evs = events(&text);
    assert_eq!(evs.last().map(String::as_str), Some("[DONE]"));
    let chunks = json_events(&evs);
    let first = &chunks[0]["choices"][0]["delta"]["tool_calls"][0];
    assert_eq!(first["index"], 0);
    assert_eq!(first["type"], "function");
    assert_eq!(first["function"]["name"], "web_search");
    assert!(first["id"].is_string());
    let arguments: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"].as_str())
        .collect();
    let args: Value = serde_json::from_str(&arguments).expect("streamed args json");
    assert_eq!(args, json!({"q": words(16)}));
    let finish: Vec<&Value> = chunks
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finish, vec![&json!("tool_calls")]);
    assert_eq!(
        chunks.last().expect("usage")["usage"]["completion_tokens"],
        16
    );
    let stats = m.mock.stats();
    assert_eq!(stats.by_fault.get("tool_call"), Some(&2));
    assert_eq!(stats.completed, 2);
    assert_eq!(stats.completion_tokens, 32);
}

#[tokio::test]
async fn cached_tokens_header() {
    let m = Mock::default().await;
    let req = body(false);
    let prompt = prompt_tokens_of(&req);
    let v: Value = json_with(&m, &req, &[("x-mock-cached-tokens", "5")]).await;
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 5);
    let v: Value = json_with(&m, &req, &[("x-mock-cached-tokens", "100000")]).await;
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], prompt);
    assert_eq!(m.mock.stats().cached_tokens, 5 + prompt);
}

#[tokio::test]
async fn malformed_requests_get_openai_errors() {
    let m = Mock::default().await;
    let resp = m
        .client
        .post(m.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 400);
    let v: Value = resp.json().await.expect("json");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert!(v["error"]["code"].is_null());
    assert!(v["error"]["message"].is_string());

    let resp = m
        .chat(&body(false))
        .header("x-mock-fault", "not_a_mode")
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 400);

    let resp = m
        .chat(&json!({"model": "mock-model"}))
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 400);

    // Over the 4 MiB limit.
    let big = json!({"messages": [{"role": "user", "content": "x".repeat(5 * 1024 * 1024)}]});
    let resp = m.chat(&big).send().await.expect("send");
    assert_eq!(resp.status(), 413);
    let v: Value = resp.json().await.expect("json");
    assert_eq!(v["error"]["type"], "invalid_request_error");

    let stats = m.mock.stats();
    assert_eq!(stats.requests, 4);
    assert_eq!(stats.by_fault.get("invalid_request"), Some(&4));
    assert_eq!(stats.prompt_tokens, 0);
    assert!(stats.max_tokens_seen.is_empty());
}

#[tokio::test]
async fn reset_zeroes_stats_and_models_lists_the_mock() {
    let m = Mock::default().await;
    m.chat(&body(false)).send().await.expect("send");
    assert_eq!(m.mock.stats().requests, 1);
    let resp = m
        .client
        .post(m.url("/mock/reset"))
        .send()
        .await
        .expect("reset");
    assert_eq!(resp.status(), 200);
    assert_eq!(m.http_stats().await, MockStats::default());

    let v: Value = m
        .client
        .get(m.url("/v1/models"))
        .send()
        .await
        .expect("models")
        .json()
        .await
        .expect("json");
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "mock-model");
}

#[tokio::test]
async fn by_fault_adds_up_to_requests() {
    let m = Mock::default().await;
    for fault in ["none", "http_429", "no_usage", "tool_call", "usage_over"] {
        m.chat(&body(false))
            .header("x-mock-fault", fault)
            .send()
            .await
            .expect("send");
    }
    let stats = m.mock.stats();
    assert_eq!(stats.requests, 5);
    assert_eq!(stats.by_fault.values().sum::<u64>(), 5);
    assert_eq!(stats.completed, 4);
    assert_eq!(stats.max_tokens_seen.len(), 5);
}

#[tokio::test]
async fn client_going_away_counts_only_emitted_tokens() {
    // 40 tokens, 4 per chunk, 40 tokens/s: one chunk every 100 ms, 1 s in all.
    let m = Mock::start(MockConfig {
        tokens_per_second: 40,
        completion_tokens: 40,
        ..MockConfig::default()
    })
    .await;
    let mut req = body(true);
    req["stream_options"] = json!({"include_usage": true});
    let resp = m.chat(&req).send().await.expect("send");
    let mut stream = resp.bytes_stream();
    let first = stream.next().await.expect("a chunk").expect("chunk ok");
    assert!(String::from_utf8_lossy(&first).contains("tok0"));
    drop(stream);
    // Wait past the time the whole stream would have taken: it must have stopped.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let stats = m.mock.stats();
    assert_eq!(stats.prompt_tokens, prompt_tokens_of(&req));
    assert_eq!(stats.completed, 0);
    assert!(
        stats.completion_tokens >= 4 && stats.completion_tokens < 40,
        "counted {}",
        stats.completion_tokens
    );
    assert_eq!(stats.completion_tokens % 4, 0);
}

/// A non-streamed request with `headers`: its JSON answer.
async fn json_with(m: &Mock, req: &Value, headers: &[(&str, &str)]) -> Value {
    let mut b = m.chat(req);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    b.send().await.expect("send").json().await.expect("json")
}

/// A streamed request with usage asked for, and `headers`: (body text, whether it errored).
async fn stream_with(m: &Mock, headers: &[(&str, &str)]) -> (String, bool) {
    let mut req = body(true);
    req["stream_options"] = json!({"include_usage": true});
    let mut b = m.chat(&req);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let resp = b.send().await.expect("send");
    assert_eq!(resp.status(), 200);
    read_stream(resp).await
}

#[tokio::test]
async fn running_usage_on_every_chunk() {
    let m = Mock::default().await;
    let prompt = prompt_tokens_of(&body(true));
    let (text, errored) = stream_with(
        &m,
        &[
            ("x-mock-running-usage", "1"),
            ("x-mock-cached-tokens", "2"),
            ("x-mock-running-cached-tokens", "7"),
        ],
    )
    .await;
    assert!(!errored);
    let events = events(&text);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks = json_events(&events);
    // 4 content chunks of 4 tokens, the finish chunk, the usage chunk.
    assert_eq!(chunks.len(), 6, "{text}");
    let running: Vec<(u64, u64)> = chunks[..5]
        .iter()
        .map(|c| {
            assert_eq!(c["usage"]["prompt_tokens"], prompt, "{c}");
            (
                c["usage"]["completion_tokens"]
                    .as_u64()
                    .expect("completion"),
                c["usage"]["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .expect("cached"),
            )
        })
        .collect();
    assert_eq!(running, [(4, 7), (8, 7), (12, 7), (16, 7), (16, 7)]);
    assert_eq!(chunks[5]["choices"], json!([]));
    assert_eq!(chunks[5]["usage"]["completion_tokens"], 16);
    assert_eq!(
        chunks[5]["usage"]["prompt_tokens_details"]["cached_tokens"],
        2
    );
    let stats = m.mock.stats();
    assert_eq!((stats.completion_tokens, stats.cached_tokens), (16, 2));
    assert_eq!(stats.completed, 1);
}

#[tokio::test]
async fn extra_completion_tokens_go_past_max_tokens() {
    let m = Mock::default().await;
    let mut req = body(false);
    req["max_tokens"] = json!(3);
    let v: Value = json_with(&m, &req, &[("x-mock-extra-completion-tokens", "5")]).await;
    assert_eq!(v["usage"]["completion_tokens"], 8);
    assert_eq!(v["choices"][0]["message"]["content"], words(8));
    assert_eq!(m.mock.stats().completion_tokens, 8);
}

/// An upstream past its bound that under-reports: the answer and the stats have every token
/// generated, the usage (final and running) at most the cap; streamed or not, with usage or
/// without (`no_usage`).
#[tokio::test]
async fn reported_completion_tokens_cap_the_usage_not_the_answer() {
    let m = Mock::default().await;
    let mut req = body(false);
    req["max_tokens"] = json!(3);
    let lie = [
        ("x-mock-extra-completion-tokens", "9"),
        ("x-mock-reported-completion-tokens", "3"),
    ];
    let v: Value = json_with(&m, &req, &lie).await;
    assert_eq!(v["usage"]["completion_tokens"], 3);
    assert_eq!(v["choices"][0]["message"]["content"], words(12));
    assert_eq!(m.mock.stats().completion_tokens, 12);

    let (text, errored) = stream_with(&m, &[lie[0], lie[1], ("x-mock-running-usage", "1")]).await;
    assert!(!errored);
    let chunks = json_events(&events(&text));
    assert_eq!(content_of(&chunks), words(16 + 9));
    assert!(chunks
        .iter()
        .filter(|c| c["usage"].is_object())
        .all(|c| c["usage"]["completion_tokens"].as_u64() <= Some(3)));
    assert_eq!(m.mock.stats().completion_tokens, 12 + 25);

    // Past the bound without any usage: every token is still sent and counted.
    let (text, _) = stream_with(&m, &[lie[0], ("x-mock-fault", "no_usage")]).await;
    let chunks = json_events(&events(&text));
    assert_eq!(content_of(&chunks), words(25));
    assert!(chunks.iter().all(|c| !c["usage"].is_object()));
    assert_eq!(m.mock.stats().completion_tokens, 12 + 25 + 25);
}

#[tokio::test]
async fn content_after_usage_fault() {
    let m = Mock::default().await;
    let (text, errored) = stream_with(&m, &[("x-mock-fault", "content_after_usage")]).await;
    assert!(!errored);
    let events = events(&text);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks = json_events(&events);
    let usage_at = chunks
        .iter()
        .position(|c| c["usage"].is_object())
        .expect("a usage chunk");
    assert_eq!(chunks[usage_at]["usage"]["completion_tokens"], 16);
    assert_eq!(usage_at + 2, chunks.len(), "one chunk after the usage");
    assert_eq!(content_of(&chunks), format!("{} tok16", words(16)));
    let stats = m.mock.stats();
    assert_eq!(stats.completion_tokens, 17);
    assert_eq!(stats.by_fault.get("content_after_usage"), Some(&1));
}

#[tokio::test]
async fn error_event_fault() {
    let m = Mock::default().await;
    let (text, errored) = stream_with(&m, &[("x-mock-fault", "error_event")]).await;
    assert!(!errored, "the body itself ends cleanly");
    let events = events(&text);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks = json_events(&events);
    let last = chunks.last().expect("chunks");
    assert_eq!(last["error"]["type"], "server_error", "{last}");
    assert_eq!(last["usage"]["completion_tokens"], 16);
    assert!(last.get("choices").is_none());
    assert!(chunks
        .iter()
        .all(|c| c["choices"][0]["finish_reason"].is_null()));
    let stats = m.mock.stats();
    assert_eq!((stats.completion_tokens, stats.completed), (16, 0));
}

#[tokio::test]
async fn clean_cut_and_no_done_faults() {
    let m = Mock::default().await;
    let (text, errored) = stream_with(&m, &[("x-mock-fault", "clean_cut")]).await;
    assert!(!errored, "a clean end");
    assert!(!text.contains("[DONE]"));
    let chunks = json_events(&events(&text));
    assert_eq!(chunks.len(), 2);
    assert_eq!(content_of(&chunks), words(8));
    assert!(chunks.iter().all(|c| c["usage"].is_null()));
    let stats = m.mock.stats();
    assert_eq!((stats.completion_tokens, stats.completed), (8, 0));

    m.mock.reset();
    let (text, errored) = stream_with(&m, &[("x-mock-fault", "no_done")]).await;
    assert!(!errored);
    assert!(!text.contains("[DONE]"));
    let chunks = json_events(&events(&text));
    let last = chunks.last().expect("chunks");
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 16);
    let stats = m.mock.stats();
    assert_eq!((stats.completion_tokens, stats.completed), (16, 1));
}

#[tokio::test]
async fn http_307_fault() {
    let m = Mock::default().await;
    let no_redirects = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("client");
    let resp = no_redirects
        .post(m.url("/v1/chat/completions"))
        .header("x-mock-fault", "http_307")
        .json(&body(false))
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 307);
    assert_eq!(
        resp.headers().get("location").and_then(|v| v.to_str().ok()),
        Some("/v1/models")
    );
    let stats = m.mock.stats();
    assert_eq!(stats.by_fault.get("http_307"), Some(&1));
    assert_eq!((stats.prompt_tokens, stats.completion_tokens), (0, 0));
}

#[tokio::test]
async fn odd_headers_fault() {
    let m = Mock::default().await;
    for stream in [false, true] {
        let resp = m
            .chat(&body(stream))
            .header("x-mock-fault", "odd_headers")
            .send()
            .await
            .expect("send");
        assert_eq!(resp.status(), 200);
        let all = |k: &str| -> Vec<String> {
            resp.headers()
                .get_all(k)
                .iter()
                .filter_map(|v| v.to_str().ok().map(str::to_owned))
                .collect()
        };
        assert_eq!(all("vary"), ["accept-encoding", "origin"]);
        assert_eq!(all("link").len(), 2);
        assert_eq!(all("spendgate-outcome"), ["released"]);
        assert_eq!(all("x-mock-hop"), ["1"]);
        assert!(all("connection").iter().any(|c| c.contains("x-mock-hop")));
        assert_eq!(all("proxy-authenticate").len(), 1);
        let (text, errored) = read_stream(resp).await;
        assert!(!errored && text.contains("tok15"), "{text}");
    }
}

/// `x-mock-tag`: each tagged request's served tokens are recorded under its tag, as the
/// aggregate stats count them: a whole answer, a stream the client left early (only what was
/// emitted), an error that did no work, and a refused tag.
#[tokio::test]
async fn tagged_requests_record_what_was_served() {
    let m = Mock::start(MockConfig {
        tokens_per_second: 200,
        ..MockConfig::default()
    })
    .await;
    let whole = json_with(
        &m,
        &json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 6}),
        &[("x-mock-tag", "whole"), ("x-mock-tokens-per-second", "0")],
    )
    .await;
    let usage = &whole["usage"];
    // A stream the client drops after its first chunk.
    let r = m
        .client
        .post(m.url("/v1/chat/completions"))
        .header("x-mock-tag", "left")
        .header("x-mock-completion-tokens", "400")
        .json(&body(true))
        .send()
        .await
        .expect("send");
    let mut s = r.bytes_stream();
    let _ = s.next().await;
    drop(s);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = m
        .client
        .post(m.url("/v1/chat/completions"))
        .header("x-mock-tag", "failed")
        .header("x-mock-fault", "http_500")
        .json(&body(false))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 500);
    let long = "x".repeat(129);
    let r = m
        .client
        .post(m.url("/v1/chat/completions"))
        .header("x-mock-tag", long)
        .json(&body(false))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 400);

    let v: Value = m
        .client
        .get(m.url("/mock/served"))
        .send()
        .await
        .expect("served")
        .json()
        .await
        .expect("json");
    let served: spendgate_mock_upstream::ServedTags = serde_json::from_value(v).expect("shape");
    assert_eq!(served.evicted, 0);
    let tags: Vec<&str> = served.served.iter().map(|s| s.tag.as_str()).collect();
    assert_eq!(tags, ["whole", "left", "failed"]);
    let [whole, left, failed] = &served.served[..] else {
        panic!("three records");
    };
    assert_eq!(
        (whole.prompt_tokens, whole.completion_tokens, whole.finished),
        (
            usage["prompt_tokens"].as_u64().expect("prompt"),
            usage["completion_tokens"].as_u64().expect("completion"),
            true
        )
    );
    assert_eq!(
        (whole.max_tokens, whole.status, whole.requests),
        (Some(6), Some(200), 1)
    );
    assert!(
        left.stream && !left.finished && left.prompt_tokens > 0,
        "{left:?}"
    );
    assert!(
        left.completion_tokens > 0 && left.completion_tokens < 400,
        "only what was emitted: {left:?}"
    );
    assert_eq!(
        (
            failed.status,
            failed.prompt_tokens,
            failed.completion_tokens,
            failed.fault.as_str()
        ),
        (Some(500), 0, 0, "http_500")
    );
    // The aggregate counts are the sums of the tagged ones (every request here was tagged).
    let stats = m.mock.stats();
    assert_eq!(
        stats.completion_tokens,
        served
            .served
            .iter()
            .map(|s| s.completion_tokens)
            .sum::<u64>()
    );
}

#[path = "it/responses.rs"]
mod responses;
