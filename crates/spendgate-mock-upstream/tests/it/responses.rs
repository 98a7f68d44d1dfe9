//! `POST /v1/responses` (OpenAI's Responses shape) against the served mock.

use std::time::Duration;

use serde_json::{json, Value};
use spendgate_mock_upstream::{responses_prompt_tokens_of, MockStats};

use super::{read_stream, words, Mock};

fn req(stream: bool) -> Value {
    json!({
        "model": "mock-model",
        "stream": stream,
        "instructions": "You are terse.",
        "input": [
            {"role": "user", "content": "Say something deterministic, please."},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "abc"}, {"type": "input_text", "text": "defgh"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"q\":\"rust\"}"},
            {"type": "function_call_output", "call_id": "c1", "output": "result"}
        ],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
    })
}

/// `req` with hosted tools (a `web_search_preview`, a `file_search`) next to its function.
fn with_hosted(stream: bool) -> Value {
    let mut r = req(stream);
    r["tools"] = json!([
        {"type": "web_search_preview"},
        {"type": "function", "name": "f", "parameters": {"type": "object"}},
        {"type": "file_search", "vector_store_ids": ["vs_1"]},
        {"type": "custom", "name": "c"}
    ]);
    r
}

async fn post(m: &Mock, body: &Value, headers: &[(&str, &str)]) -> reqwest::Response {
    let mut b = m.client.post(m.url("/v1/responses")).json(body);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    b.send().await.expect("send")
}

async fn whole(m: &Mock, body: &Value, headers: &[(&str, &str)]) -> Value {
    let resp = post(m, body, headers).await;
    assert_eq!(resp.status(), 200);
    resp.json().await.expect("json")
}

/// A Responses stream: its events as (type, data), and whether the body errored.
async fn stream(m: &Mock, body: &Value, headers: &[(&str, &str)]) -> (Vec<(String, Value)>, bool) {
    let resp = post(m, body, headers).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok()),
        Some("text/event-stream")
    );
    let (text, errored) = read_stream(resp).await;
    (sse_events(&text), errored)
}

fn sse_events(text: &str) -> Vec<(String, Value)> {
    text.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let (head, data) = e
                .split_once('\n')
                .unwrap_or_else(|| panic!("not an event: {e:?}"));
            let kind = head.strip_prefix("event: ").expect("event line");
            let data: Value = serde_json::from_str(data.strip_prefix("data: ").expect("data line"))
                .expect("data json");
            assert_eq!(data["type"], kind, "{data}");
            (kind.to_owned(), data)
        })
        .collect()
}

fn types(events: &[(String, Value)]) -> Vec<&str> {
    events.iter().map(|(t, _)| t.as_str()).collect()
}

fn text_deltas(events: &[(String, Value)]) -> String {
    events
        .iter()
        .filter(|(t, _)| t == "response.output_text.delta")
        .filter_map(|(_, d)| d["delta"].as_str())
        .collect()
}

fn usage(input: u64, output: u64, reasoning: u64, cached: u64) -> Value {
    json!({
        "input_tokens": input,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": input + output,
    })
}

fn assert_stats(s: &MockStats, prompt: u64, completion: u64, completed: u64) {
    assert_eq!(
        (s.prompt_tokens, s.completion_tokens, s.completed),
        (prompt, completion, completed),
        "{s:?}"
    );
}

#[tokio::test]
async fn responses_prompt_tokens_follow_the_documented_rule() {
    let r = req(false);
    let tool_bytes = serde_json::to_string(&r["tools"][0]).map_or(0, |s| s.len() as u64);
    // instructions 14 -> 4; the user text 36 -> 9; "abcdefgh" -> 2; arguments 12 -> 3;
    // "result" -> 2; +4 each, +3, and the function tool's JSON.
    assert_eq!(
        responses_prompt_tokens_of(&r),
        3 + (4 + 4) + (9 + 4) + (2 + 4) + (3 + 4) + (2 + 4) + tool_bytes.div_ceil(4)
    );
    assert_eq!(
        responses_prompt_tokens_of(&json!({"input": "hello"})),
        3 + 2 + 4
    );
}

#[tokio::test]
async fn responses_whole_answer_and_stats() {
    let m = Mock::default().await;
    let mut r = req(false);
    r["previous_response_id"] = json!("resp_prev");
    r["store"] = json!(false);
    let prompt = responses_prompt_tokens_of(&r);
    let v = whole(&m, &r, &[("x-mock-cached-tokens", "5")]).await;
    assert_eq!(v["object"], "response");
    assert!(v["id"]
        .as_str()
        .is_some_and(|id| id.starts_with("resp_mock_")));
    assert_eq!(v["status"], "completed");
    assert_eq!(v["incomplete_details"], Value::Null);
    assert_eq!(v["model"], "mock-model");
    assert_eq!(v["previous_response_id"], "resp_prev");
    assert_eq!(v["store"], false);
    assert_eq!(v["tools"], r["tools"]);
    assert_eq!(v["max_output_tokens"], Value::Null);
    assert_eq!(v["error"], Value::Null);
    let output = v["output"].as_array().expect("output");
    assert_eq!(output.len(), 1);
    assert_eq!(output[0]["type"], "message");
    assert_eq!(output[0]["role"], "assistant");
    assert_eq!(
        output[0]["content"],
        json!([{"type": "output_text", "text": words(16), "annotations": []}])
    );
    assert_eq!(v["usage"], usage(prompt, 16, 0, 5));
    let s = m.http_stats().await;
    assert_eq!(s, m.mock.stats());
    assert_stats(&s, prompt, 16, 1);
    assert_eq!(s.cached_tokens, 5);
    assert_eq!(s.by_shape.get("responses"), Some(&1));
    assert_eq!(s.by_fault.get("none"), Some(&1));
    assert_eq!(s.hosted_tool_calls, 0);

    // Without `input`: a 400 in OpenAI's error shape, counted as refused.
    let resp = post(&m, &json!({"model": "mock-model"}), &[]).await;
    assert_eq!(resp.status(), 400);
    let e: Value = resp.json().await.expect("json");
    assert_eq!(e["error"]["type"], "invalid_request_error");
    assert!(e["error"]["message"]
        .as_str()
        .is_some_and(|s| s.contains("input")));
    let s = m.mock.stats();
    assert_eq!(s.by_shape.get("responses"), Some(&2));
    assert_eq!(s.by_fault.get("invalid_request"), Some(&1));
    assert_eq!(s.prompt_tokens, prompt);
}

#[tokio::test]
async fn responses_max_output_tokens_makes_it_incomplete() {
    let m = Mock::default().await;
    let mut r = req(false);
    r["max_output_tokens"] = json!(5);
    let v = whole(&m, &r, &[]).await;
    assert_eq!(v["status"], "incomplete");
    assert_eq!(
        v["incomplete_details"],
        json!({"reason": "max_output_tokens"})
    );
    assert_eq!(v["max_output_tokens"], 5);
    assert_eq!(v["usage"]["output_tokens"], 5);
    assert_eq!(v["output"][0]["content"][0]["text"], words(5));
    assert_eq!(m.mock.stats().max_tokens_seen, vec![5]);

    // A bound above the length: completed; a null bound counts as absent.
    r["max_output_tokens"] = json!(100);
    assert_eq!(whole(&m, &r, &[]).await["status"], "completed");
    r["max_output_tokens"] = Value::Null;
    let v = whole(&m, &r, &[]).await;
    assert_eq!(
        (v["status"].as_str(), v["usage"]["output_tokens"].as_u64()),
        (Some("completed"), Some(16))
    );

    // Streamed: the last event is `response.incomplete`; extra tokens go past the bound.
    let mut r = req(true);
    r["max_output_tokens"] = json!(5);
    let (events, errored) = stream(&m, &r, &[("x-mock-extra-completion-tokens", "3")]).await;
    assert!(!errored);
    let (last, data) = events.last().expect("events");
    assert_eq!(last, "response.incomplete");
    assert_eq!(data["response"]["status"], "incomplete");
    assert_eq!(data["response"]["usage"]["output_tokens"], 8);
    assert_eq!(text_deltas(&events), words(8));
}

#[tokio::test]
async fn responses_stream_events_and_usage_equal_stats() {
    let m = Mock::default().await;
    let r = req(true);
    let prompt = responses_prompt_tokens_of(&r);
    let (events, errored) = stream(&m, &r, &[]).await;
    assert!(!errored);
    for (k, (_, data)) in events.iter().enumerate() {
        assert_eq!(data["sequence_number"], k as u64, "{data}");
    }
    let t = types(&events);
    assert_eq!(
        t,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    let created = &events[0].1["response"];
    assert_eq!(created["status"], "in_progress");
    assert_eq!(created["output"], json!([]));
    assert_eq!(created["usage"], Value::Null);
    assert_eq!(events[2].1["item"]["type"], "message");
    assert_eq!(events[2].1["item"]["content"], json!([]));
    let delta = &events[4].1;
    assert_eq!(delta["output_index"], 0);
    assert_eq!(delta["content_index"], 0);
    assert_eq!(delta["item_id"], events[2].1["item"]["id"]);
    assert_eq!(text_deltas(&events), words(16));
    assert_eq!(events[8].1["text"], words(16));
    let done = &events[11].1["response"];
    assert_eq!(done["status"], "completed");
    assert_eq!(done["usage"], usage(prompt, 16, 0, 0));
    assert_eq!(done["output"][0]["content"][0]["text"], words(16));
    let s = m.http_stats().await;
    assert_stats(&s, prompt, 16, 1);
    assert_eq!(s.by_shape.get("responses"), Some(&1));
}

#[tokio::test]
async fn responses_hosted_tool_calls_are_counted_and_capped() {
    let m = Mock::default().await;
    // One call per hosted tool: the web search's, then the file search's, then the message.
    let v = whole(&m, &with_hosted(false), &[]).await;
    let output = v["output"].as_array().expect("output");
    let kinds: Vec<&str> = output.iter().filter_map(|o| o["type"].as_str()).collect();
    assert_eq!(kinds, ["web_search_call", "file_search_call", "message"]);
    assert_eq!(output[0]["status"], "completed");
    assert!(output[0]["id"]
        .as_str()
        .is_some_and(|id| id.starts_with("web_search_mock_")));
    assert_ne!(output[0]["id"], output[1]["id"]);
    let s = m.mock.stats();
    assert_eq!(s.hosted_tool_calls, 2);
    assert_eq!(s.hosted_tool_calls_by_type.get("web_search_call"), Some(&1));
    assert_eq!(
        s.hosted_tool_calls_by_type.get("file_search_call"),
        Some(&1)
    );

    // 3 per tool, at most max_tool_calls = 4, and 2 more past the bound to the first tool.
    m.mock.reset();
    let mut r = with_hosted(false);
    r["max_tool_calls"] = json!(4);
    let h = [
        ("x-mock-hosted-tool-calls", "3"),
        ("x-mock-extra-hosted-tool-calls", "2"),
    ];
    let v = whole(&m, &r, &h).await;
    let kinds: Vec<&str> = v["output"]
        .as_array()
        .expect("output")
        .iter()
        .filter_map(|o| o["type"].as_str())
        .collect();
    assert_eq!(
        kinds,
        [
            "web_search_call",
            "web_search_call",
            "web_search_call",
            "file_search_call",
            "web_search_call",
            "web_search_call",
            "message"
        ]
    );
    assert_eq!(v["max_tool_calls"], 4);
    let s = m.mock.stats();
    assert_eq!(s.hosted_tool_calls, 6);
    assert_eq!(s.hosted_tool_calls_by_type.get("web_search_call"), Some(&5));
    assert_eq!(
        s.hosted_tool_calls_by_type.get("file_search_call"),
        Some(&1)
    );

    // Streamed: each call added (in progress) then done, before the message; counted as sent.
    m.mock.reset();
    let mut r = with_hosted(true);
    r["max_tool_calls"] = json!(1);
    let (events, errored) = stream(&m, &r, &[("x-mock-extra-hosted-tool-calls", "1")]).await;
    assert!(!errored);
    let items: Vec<(&str, &str, u64)> = events
        .iter()
        .filter(|(t, _)| t.starts_with("response.output_item."))
        .map(|(t, d)| {
            (
                t.as_str(),
                d["item"]["status"].as_str().unwrap_or(""),
                d["output_index"].as_u64().unwrap_or(99),
            )
        })
        .collect();
    assert_eq!(
        items,
        [
            ("response.output_item.added", "in_progress", 0),
            ("response.output_item.done", "completed", 0),
            ("response.output_item.added", "in_progress", 1),
            ("response.output_item.done", "completed", 1),
            ("response.output_item.added", "in_progress", 2),
            ("response.output_item.done", "completed", 2),
        ]
    );
    let (_, last) = events.last().expect("events");
    let final_kinds: Vec<&str> = last["response"]["output"]
        .as_array()
        .expect("output")
        .iter()
        .filter_map(|o| o["type"].as_str())
        .collect();
    assert_eq!(
        final_kinds,
        ["web_search_call", "web_search_call", "message"]
    );
    let s = m.mock.stats();
    assert_eq!(s.hosted_tool_calls, 2);
    assert_eq!(s.hosted_tool_calls_by_type.get("web_search_call"), Some(&2));
    assert_eq!(s.hosted_tool_calls_by_type.get("file_search_call"), None);
}

#[tokio::test]
async fn responses_reasoning_tokens_count_in_the_output() {
    let m = Mock::default().await;
    let r = req(false);
    let prompt = responses_prompt_tokens_of(&r);
    let v = whole(&m, &r, &[("x-mock-reasoning-tokens", "5")]).await;
    assert_eq!(v["usage"], usage(prompt, 16, 5, 0));
    assert_eq!(v["output"][0]["content"][0]["text"], words(11));
    // Capped at the output.
    let v = whole(&m, &r, &[("x-mock-reasoning-tokens", "99")]).await;
    assert_eq!(v["usage"], usage(prompt, 16, 16, 0));
    assert_eq!(v["output"][0]["content"][0]["text"], "");
    assert_stats(&m.mock.stats(), 2 * prompt, 32, 2);

    m.mock.reset();
    let (events, errored) = stream(&m, &req(true), &[("x-mock-reasoning-tokens", "6")]).await;
    assert!(!errored);
    assert_eq!(text_deltas(&events), words(10));
    let (_, last) = events.last().expect("events");
    assert_eq!(last["response"]["usage"], usage(prompt, 16, 6, 0));
    assert_stats(&m.mock.stats(), prompt, 16, 1);

    // All reasoning, streamed: no delta, the text is empty, still complete.
    m.mock.reset();
    let (events, _) = stream(&m, &req(true), &[("x-mock-reasoning-tokens", "16")]).await;
    assert_eq!(text_deltas(&events), "");
    assert_eq!(
        events.last().map(|(t, _)| t.as_str()),
        Some("response.completed")
    );
    assert_stats(&m.mock.stats(), prompt, 16, 1);
}

#[tokio::test]
async fn responses_error_statuses() {
    let m = Mock::default().await;
    let r = with_hosted(false);
    let prompt = responses_prompt_tokens_of(&r);
    for (fault, status, kind) in [
        ("http_429", 429, "rate_limit_error"),
        ("http_500", 500, "server_error"),
    ] {
        let resp = post(&m, &r, &[("x-mock-fault", fault)]).await;
        assert_eq!(resp.status(), status);
        let e: Value = resp.json().await.expect("json");
        assert_eq!(e["error"]["type"], kind);
    }
    assert_stats(&m.mock.stats(), 0, 0, 0);

    let no_redirects = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("client");
    let resp = no_redirects
        .post(m.url("/v1/responses"))
        .header("x-mock-fault", "http_307")
        .json(&r)
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 307);
    assert_eq!(
        resp.headers().get("location").and_then(|v| v.to_str().ok()),
        Some("/v1/models")
    );
    assert_stats(&m.mock.stats(), 0, 0, 0);

    // 504: the work (hosted calls included) is counted, then refused.
    let resp = post(&m, &r, &[("x-mock-fault", "http_504")]).await;
    assert_eq!(resp.status(), 504);
    let s = m.mock.stats();
    assert_stats(&s, prompt, 16, 0);
    assert_eq!(s.hosted_tool_calls, 2);
    for f in ["http_429", "http_500", "http_307", "http_504"] {
        assert_eq!(s.by_fault.get(f), Some(&1), "{f}");
    }
}

#[tokio::test]
async fn responses_hang_and_drops() {
    let m = Mock::default().await;
    let r = req(false);
    let prompt = responses_prompt_tokens_of(&r);
    let err = m
        .client
        .post(m.url("/v1/responses"))
        .header("x-mock-fault", "hang")
        .timeout(Duration::from_millis(300))
        .json(&r)
        .send()
        .await
        .expect_err("a hung request must not complete");
    assert!(err.is_timeout(), "{err:?}");
    assert_stats(&m.mock.stats(), prompt, 0, 0);

    // Not streaming: the connection is aborted.
    m.mock.reset();
    let outcome = match post_result(&m, &r, "drop_mid_stream").await {
        Ok(resp) => resp.bytes().await.map(|_| ()),
        Err(e) => Err(e),
    };
    assert!(
        outcome.is_err(),
        "a dropped answer must not read as complete"
    );
    assert_stats(&m.mock.stats(), prompt, 0, 0);

    // Streaming: 2 deltas, then the abort.
    m.mock.reset();
    let (events, errored) = stream(
        &m,
        &with_hosted(true),
        &[("x-mock-fault", "drop_mid_stream")],
    )
    .await;
    assert!(errored, "the stream must end in an error");
    assert_eq!(text_deltas(&events), words(8));
    assert_eq!(types(&events).last(), Some(&"response.output_text.delta"));
    let s = m.mock.stats();
    assert_stats(&s, responses_prompt_tokens_of(&with_hosted(true)), 8, 0);
    assert_eq!(s.hosted_tool_calls, 2, "sent before the drop");

    // clean_cut: 2 deltas, then the body ends cleanly.
    m.mock.reset();
    let (events, errored) = stream(&m, &req(true), &[("x-mock-fault", "clean_cut")]).await;
    assert!(!errored);
    assert_eq!(text_deltas(&events), words(8));
    assert_eq!(types(&events).last(), Some(&"response.output_text.delta"));
    assert_stats(&m.mock.stats(), prompt, 8, 0);
}

async fn post_result(m: &Mock, body: &Value, fault: &str) -> reqwest::Result<reqwest::Response> {
    m.client
        .post(m.url("/v1/responses"))
        .header("x-mock-fault", fault)
        .json(body)
        .send()
        .await
}

#[tokio::test]
async fn responses_usage_faults() {
    let m = Mock::default().await;
    let prompt = responses_prompt_tokens_of(&req(false));
    let v = whole(&m, &req(false), &[("x-mock-fault", "no_usage")]).await;
    assert_eq!(v["usage"], Value::Null);
    assert_eq!(v["output"][0]["content"][0]["text"], words(16));
    let (events, _) = stream(&m, &req(true), &[("x-mock-fault", "no_usage")]).await;
    let (last, data) = events.last().expect("events");
    assert_eq!(last, "response.completed");
    assert_eq!(data["response"]["usage"], Value::Null);
    assert_stats(&m.mock.stats(), 2 * prompt, 32, 2);

    // usage_over: max_output_tokens + 10, generated and reported.
    m.mock.reset();
    let mut r = req(false);
    r["max_output_tokens"] = json!(4);
    let v = whole(&m, &r, &[("x-mock-fault", "usage_over")]).await;
    assert_eq!(v["usage"]["output_tokens"], 14);
    assert_eq!(v["output"][0]["content"][0]["text"], words(14));
    r["stream"] = json!(true);
    let (events, _) = stream(&m, &r, &[("x-mock-fault", "usage_over")]).await;
    assert_eq!(text_deltas(&events), words(14));
    assert_eq!(
        events.last().expect("events").1["response"]["usage"]["output_tokens"],
        14
    );
    assert_stats(&m.mock.stats(), 2 * prompt, 28, 2);

    // A reported cap lowers the usage, not the answer (nor the stats).
    m.mock.reset();
    let h = [
        ("x-mock-reported-completion-tokens", "5"),
        ("x-mock-reasoning-tokens", "8"),
    ];
    let v = whole(&m, &req(false), &h).await;
    assert_eq!(v["usage"], usage(prompt, 5, 5, 0));
    assert_eq!(v["output"][0]["content"][0]["text"], words(8));
    assert_stats(&m.mock.stats(), prompt, 16, 1);
}

#[tokio::test]
async fn responses_stream_tail_faults() {
    let m = Mock::default().await;
    let prompt = responses_prompt_tokens_of(&req(true));
    // content_after_usage: one more delta of one token after response.completed.
    let (events, errored) =
        stream(&m, &req(true), &[("x-mock-fault", "content_after_usage")]).await;
    assert!(!errored);
    let t = types(&events);
    assert_eq!(
        &t[t.len() - 2..],
        ["response.completed", "response.output_text.delta"]
    );
    assert_eq!(
        events[t.len() - 2].1["response"]["usage"]["output_tokens"],
        16
    );
    assert_eq!(events[t.len() - 1].1["delta"], " tok16");
    assert_stats(&m.mock.stats(), prompt, 17, 1);

    // error_event: after the deltas, `error` then `response.failed` with the usage so far.
    m.mock.reset();
    let (events, errored) = stream(
        &m,
        &req(true),
        &[
            ("x-mock-fault", "error_event"),
            ("x-mock-reasoning-tokens", "2"),
        ],
    )
    .await;
    assert!(!errored);
    let t = types(&events);
    assert!(!t.contains(&"response.completed"));
    assert_eq!(
        &t[t.len() - 3..],
        ["response.output_text.delta", "error", "response.failed"]
    );
    let error = &events[t.len() - 2].1;
    assert_eq!(
        (
            error["code"].as_str(),
            error["message"].as_str(),
            &error["param"]
        ),
        (Some("server_error"), Some("mock error event"), &Value::Null)
    );
    assert_eq!(error["sequence_number"], t.len() - 2);
    let failed = &events[t.len() - 1].1["response"];
    assert_eq!(failed["status"], "failed");
    assert_eq!(failed["usage"], usage(prompt, 16, 2, 0));
    assert_eq!(text_deltas(&events), words(14));
    assert_stats(&m.mock.stats(), prompt, 16, 0);

    // no_done: behaves (a Responses stream has no `[DONE]`).
    m.mock.reset();
    let (events, errored) = stream(&m, &req(true), &[("x-mock-fault", "no_done")]).await;
    assert!(!errored);
    assert_eq!(
        events.last().map(|(t, _)| t.as_str()),
        Some("response.completed")
    );
    assert_stats(&m.mock.stats(), prompt, 16, 1);
}

#[tokio::test]
async fn responses_tool_call_fault() {
    let m = Mock::default().await;
    let h = [
        ("x-mock-fault", "tool_call"),
        ("x-mock-completion-tokens", "6"),
    ];
    let v = whole(&m, &with_hosted(false), &h).await;
    let output = v["output"].as_array().expect("output");
    assert_eq!(output.len(), 3);
    let call = &output[2];
    assert_eq!(call["type"], "function_call");
    assert!(call["id"]
        .as_str()
        .is_some_and(|id| id.starts_with("fc_mock_")));
    assert!(call["call_id"]
        .as_str()
        .is_some_and(|id| id.starts_with("call_mock_")));
    assert_eq!(call["name"], "web_search");
    assert_eq!(call["status"], "completed");
    let args: Value =
        serde_json::from_str(call["arguments"].as_str().expect("args")).expect("json");
    assert_eq!(args, json!({"q": words(6)}));
    assert_eq!(v["usage"]["output_tokens"], 6);

    let (events, errored) = stream(&m, &req(true), &h).await;
    assert!(!errored);
    let t = types(&events);
    assert!(!t.contains(&"response.output_text.delta"));
    assert!(!t.contains(&"response.content_part.added"));
    let args: String = events
        .iter()
        .filter(|(t, _)| t == "response.function_call_arguments.delta")
        .filter_map(|(_, d)| d["delta"].as_str())
        .collect();
    assert_eq!(
        t.iter()
            .filter(|t| **t == "response.function_call_arguments.delta")
            .count(),
        2
    );
    let done = events
        .iter()
        .find(|(t, _)| t == "response.function_call_arguments.done")
        .expect("arguments done");
    assert_eq!(done.1["arguments"], args);
    assert_eq!(
        serde_json::from_str::<Value>(&args).expect("json"),
        json!({"q": words(6)})
    );
    let (last, data) = events.last().expect("events");
    assert_eq!(last, "response.completed");
    assert_eq!(data["response"]["output"][0]["type"], "function_call");
    assert_eq!(data["response"]["usage"]["output_tokens"], 6);
    let s = m.mock.stats();
    assert_eq!(
        (s.completion_tokens, s.completed, s.hosted_tool_calls),
        (12, 2, 2)
    );
}

#[tokio::test]
async fn responses_odd_headers_latency_and_tags() {
    let m = Mock::default().await;
    let resp = post(
        &m,
        &req(true),
        &[
            ("x-mock-fault", "odd_headers"),
            ("x-mock-latency-ms", "150"),
            ("x-mock-tag", "resp-1"),
        ],
    )
    .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers().get_all("vary").iter().count(), 2);
    assert!(resp.headers().get("spendgate-outcome").is_some());
    let (text, errored) = read_stream(resp).await;
    assert!(!errored && text.contains("response.completed"));

    // Model suffix faults apply; the paced stream takes its time.
    let mut r = with_hosted(true);
    r["model"] = json!("mock-model:clean_cut");
    let started = std::time::Instant::now();
    let (events, _) = stream(
        &m,
        &r,
        &[("x-mock-tokens-per-second", "40"), ("x-mock-tag", "resp-2")],
    )
    .await;
    assert!(
        started.elapsed() >= Duration::from_millis(190),
        "8 tokens at 40/s"
    );
    assert_eq!(text_deltas(&events), words(8));
    let served = m.mock.served().served;
    assert_eq!(served.len(), 2);
    assert_eq!(
        (served[0].shape.as_str(), served[0].finished),
        ("responses", true)
    );
    assert_eq!(
        (served[0].completion_tokens, served[0].hosted_tool_calls),
        (16, 0)
    );
    assert_eq!(served[1].fault, "clean_cut");
    assert_eq!(
        (served[1].completion_tokens, served[1].hosted_tool_calls),
        (8, 2)
    );
    assert!(!served[1].finished);
}

/// The Python with the official `openai` package: `SPENDGATE_TEST_PYTHON`, else the
/// workspace's `.venv` (both made by `scripts/test.sh`).
fn test_python() -> std::path::PathBuf {
    let path = std::env::var_os("SPENDGATE_TEST_PYTHON").map_or_else(
        || std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python"),
        std::path::PathBuf::from,
    );
    assert!(
        path.exists(),
        "no Python with the `openai` package at {}: set SPENDGATE_TEST_PYTHON, or at the \
         workspace root run: python3 -m venv .venv && .venv/bin/pip install openai",
        path.display()
    );
    path
}

/// Drives the mock with the official client: `responses.create` whole and streamed, and the
/// `responses.stream` helper (which rebuilds the answer from the events), printing one JSON
/// line of what it parsed.
const OPENAI_CLIENT_SCRIPT: &str = r#"
import json, sys
from openai import OpenAI

client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="sk-mock", max_retries=0)
tools = [{"type": "web_search_preview"},
         {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}]
r = client.responses.create(
    model="mock-model", input="hello there", instructions="be brief", tools=tools,
    max_output_tokens=10, extra_headers={"x-mock-reasoning-tokens": "3"})
out = {
    "whole": {"text": r.output_text, "status": r.status, "id": r.id,
              "input_tokens": r.usage.input_tokens, "output_tokens": r.usage.output_tokens,
              "reasoning_tokens": r.usage.output_tokens_details.reasoning_tokens,
              "cached_tokens": r.usage.input_tokens_details.cached_tokens,
              "total_tokens": r.usage.total_tokens,
              "types": [o.type for o in r.output]},
}
text, kinds, final = "", [], None
for ev in client.responses.create(model="mock-model", input="hello there", stream=True):
    kinds.append(ev.type)
    if ev.type == "response.output_text.delta":
        text += ev.delta
    if ev.type == "response.completed":
        final = ev.response
out["stream"] = {"text": text, "final_text": final.output_text, "kinds": kinds,
                 "input_tokens": final.usage.input_tokens,
                 "output_tokens": final.usage.output_tokens}
with client.responses.stream(model="mock-model", input=[{"role": "user", "content": "hi"}],
                             tools=tools) as s:
    for _ in s:
        pass
    f = s.get_final_response()
out["helper"] = {"text": f.output_text, "types": [o.type for o in f.output],
                 "output_tokens": f.usage.output_tokens}
print(json.dumps(out))
"#;

#[tokio::test]
async fn responses_parse_with_the_official_openai_client() {
    let m = Mock::default().await;
    let python = test_python();
    let base = m.base.clone();
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(python)
            .arg("-c")
            .arg(OPENAI_CLIENT_SCRIPT)
            .arg(base)
            .output()
    })
    .await
    .expect("join")
    .expect("run python");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "the openai client failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let v: Value = serde_json::from_str(stdout.trim()).expect("the script's JSON");

    let whole_prompt = responses_prompt_tokens_of(&json!({
        "input": "hello there", "instructions": "be brief",
        "tools": [{"type": "web_search_preview"},
                  {"type": "function", "name": "f",
                   "parameters": {"type": "object", "properties": {}}}]}));
    let w = &v["whole"];
    assert_eq!(w["text"], words(7), "{w}");
    assert_eq!(w["status"], "incomplete");
    assert_eq!(w["types"], json!(["web_search_call", "message"]));
    assert_eq!(
        (
            &w["input_tokens"],
            &w["output_tokens"],
            &w["reasoning_tokens"]
        ),
        (&json!(whole_prompt), &json!(10), &json!(3))
    );
    assert_eq!(w["total_tokens"], whole_prompt + 10);
    assert_eq!(w["cached_tokens"], 0);

    let s = &v["stream"];
    assert_eq!(s["text"], words(16), "{s}");
    assert_eq!(s["final_text"], words(16));
    assert_eq!(s["kinds"][0], "response.created");
    assert_eq!(s["output_tokens"], 16);
    let stream_prompt = responses_prompt_tokens_of(&json!({"input": "hello there"}));
    assert_eq!(s["input_tokens"], stream_prompt);

    let h = &v["helper"];
    assert_eq!(h["text"], words(16), "{h}");
    assert_eq!(h["types"], json!(["web_search_call", "message"]));

    let helper_prompt =
        responses_prompt_tokens_of(&json!({"input": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "name": "f",
                       "parameters": {"type": "object", "properties": {}}}]}));
    let stats = m.mock.stats();
    assert_stats(
        &stats,
        whole_prompt + stream_prompt + helper_prompt,
        10 + 16 + 16,
        3,
    );
    assert_eq!(
        stats.hosted_tool_calls_by_type.get("web_search_call"),
        Some(&2)
    );
    assert_eq!(stats.by_shape.get("responses"), Some(&3));
}
