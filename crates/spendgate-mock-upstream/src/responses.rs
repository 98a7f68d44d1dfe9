//! `POST /v1/responses`: OpenAI's Responses shape (see the crate docs' Responses section).

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::tokens::{self, PER_MESSAGE_TOKENS, PER_REQUEST_TOKENS};
use crate::{body_u64, header_u64, Fault, MockUpstream, Plan};

/// Header `x-mock-hosted-tool-calls: N`: calls per hosted tool (default 1).
pub const HOSTED_TOOL_CALLS_HEADER: &str = "x-mock-hosted-tool-calls";
/// Header `x-mock-extra-hosted-tool-calls: M`: calls of the first hosted tool beyond the
/// body's `max_tool_calls` (an upstream that ignores it).
pub const EXTRA_HOSTED_TOOL_CALLS_HEADER: &str = "x-mock-extra-hosted-tool-calls";
/// Header `x-mock-reasoning-tokens: N`: that many of the output tokens are reasoning.
pub const REASONING_TOKENS_HEADER: &str = "x-mock-reasoning-tokens";
/// Most hosted tool calls within the bound (per tool times tools, or `max_tool_calls`), and
/// separately the most extra ones, one answer holds.
pub const MAX_HOSTED_TOOL_CALLS: u64 = 1024;

/// How many deltas `drop_mid_stream` and `clean_cut` send before they end.
const DELTAS_BEFORE_DROP: u64 = 2;

/// What a Responses request adds to its plan.
#[derive(Clone, Debug, Default)]
pub(crate) struct Extras {
    /// Output tokens that are reasoning (within the plan's completion tokens; not shown).
    pub(crate) reasoning_tokens: u64,
    /// The kind of each hosted tool call the answer holds, in order (`"web_search"`, ...).
    pub(crate) hosted: Vec<String>,
    /// The request fields the answer echoes (an object).
    pub(crate) echo: Value,
}

/// The deterministic prompt-token count (`input_tokens`) the mock reports for a Responses
/// request body:
///
/// ```text
/// input_tokens = 3
///              + (ceil(bytes(instructions) / 4) + 4)          when `instructions` is a string
///              + (ceil(bytes(input) / 4) + 4)                 when `input` is a string
///              + Σ over input items of (ceil(text bytes / 4) + 4)   when it is an array
///              + Σ over tools of type "function" of ceil(bytes(compact JSON of the tool) / 4)
/// ```
///
/// An item's text is: for a message (`{"role", "content"}`, with or without
/// `"type": "message"`) its string content, or the concatenated string `text` fields of its
/// content parts; for a `function_call` item its `arguments`; for a `function_call_output`
/// item its `output` when that is a string; for any other item nothing (the item still counts
/// its 4). A tool's JSON is serde_json's compact form (no whitespace, non-ASCII unescaped),
/// whose length does not depend on key order. A body without `input` counts what it has.
pub fn responses_prompt_tokens_of(body: &Value) -> u64 {
    let entry = |bytes: u64| bytes.div_ceil(4).saturating_add(PER_MESSAGE_TOKENS);
    let mut total = PER_REQUEST_TOKENS;
    if let Some(s) = body.get("instructions").and_then(Value::as_str) {
        total = total.saturating_add(entry(len_u64(s)));
    }
    match body.get("input") {
        Some(Value::String(s)) => total = total.saturating_add(entry(len_u64(s))),
        Some(Value::Array(items)) => {
            for item in items {
                total = total.saturating_add(entry(item_text_bytes(item)));
            }
        }
        _ => {}
    }
    if let Some(tools) = body.get("tools").and_then(Value::as_array) {
        for tool in tools {
            if tool.get("type").and_then(Value::as_str) == Some("function") {
                let bytes = serde_json::to_string(tool).map_or(0, |s| len_u64(&s));
                total = total.saturating_add(bytes.div_ceil(4));
            }
        }
    }
    total
}

fn len_u64(s: &str) -> u64 {
    u64::try_from(s.len()).unwrap_or(u64::MAX)
}

/// The text bytes of one input item (see [`responses_prompt_tokens_of`]).
fn item_text_bytes(item: &Value) -> u64 {
    let text = |field: &str| item.get(field).and_then(Value::as_str).map_or(0, len_u64);
    match item.get("type").and_then(Value::as_str) {
        Some("function_call") => text("arguments"),
        Some("function_call_output") => text("output"),
        None | Some("message") => match item.get("content") {
            Some(Value::String(s)) => len_u64(s),
            Some(Value::Array(parts)) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .map(len_u64)
                .fold(0, u64::saturating_add),
            _ => 0,
        },
        Some(_) => 0,
    }
}

/// The prompt tokens of a Responses request, refusing one without a usable `input`.
pub(crate) fn prompt_tokens(body: &Value) -> Result<u64, String> {
    match body.get("input") {
        None | Some(Value::Null) => return Err("Missing required parameter: 'input'.".to_owned()),
        Some(Value::String(_) | Value::Array(_)) => {}
        Some(_) => return Err("input must be a string or an array of items".to_owned()),
    }
    match body.get("instructions") {
        None | Some(Value::Null | Value::String(_)) => {}
        Some(_) => return Err("instructions must be a string".to_owned()),
    }
    Ok(responses_prompt_tokens_of(body))
}

/// The hosted kind of a tool (`None` for `function`, `custom` and tools without a type).
fn hosted_kind(tool: &Value) -> Option<String> {
    match tool.get("type").and_then(Value::as_str)? {
        "function" | "custom" => None,
        t if t == "web_search" || t.starts_with("web_search_preview") => {
            Some("web_search".to_owned())
        }
        t => Some(t.to_owned()),
    }
}

/// The Responses part of a plan: reasoning tokens (at most `output_tokens`), hosted calls,
/// echoed fields.
pub(crate) fn extras(
    headers: &HeaderMap,
    body: &Value,
    output_tokens: u64,
) -> Result<Extras, String> {
    let per_tool = header_u64(headers, HOSTED_TOOL_CALLS_HEADER)?.unwrap_or(1);
    let extra = header_u64(headers, EXTRA_HOSTED_TOOL_CALLS_HEADER)?
        .unwrap_or(0)
        .min(MAX_HOSTED_TOOL_CALLS);
    let reasoning_tokens = header_u64(headers, REASONING_TOKENS_HEADER)?
        .unwrap_or(0)
        .min(output_tokens);
    let max_tool_calls = body_u64(body, "max_tool_calls")?;
    let tools: &[Value] = match body.get("tools") {
        None | Some(Value::Null) => &[],
        Some(Value::Array(a)) => a,
        Some(_) => return Err("tools must be an array".to_owned()),
    };
    let kinds: Vec<String> = tools.iter().filter_map(hosted_kind).collect();
    let cap = max_tool_calls
        .unwrap_or(MAX_HOSTED_TOOL_CALLS)
        .min(MAX_HOSTED_TOOL_CALLS);
    let mut hosted = Vec::new();
    'tools: for kind in &kinds {
        for _ in 0..per_tool {
            if len_of(&hosted) >= cap {
                break 'tools;
            }
            hosted.push(kind.clone());
        }
    }
    if let Some(first) = kinds.first() {
        for _ in 0..extra {
            hosted.push(first.clone());
        }
    }
    let field = |name: &str, default: Value| match body.get(name) {
        None => default,
        Some(v) => v.clone(),
    };
    let echo = json!({
        "instructions": field("instructions", Value::Null),
        "max_output_tokens": field("max_output_tokens", Value::Null),
        "max_tool_calls": field("max_tool_calls", Value::Null),
        "previous_response_id": field("previous_response_id", Value::Null),
        "reasoning": field("reasoning", Value::Null),
        "store": match body.get("store") {
            None | Some(Value::Null) => json!(true),
            Some(v) => v.clone(),
        },
        "tools": match body.get("tools") {
            None | Some(Value::Null) => json!([]),
            Some(v) => v.clone(),
        },
    });
    Ok(Extras {
        reasoning_tokens,
        hosted,
        echo,
    })
}

fn len_of<T>(v: &[T]) -> u64 {
    u64::try_from(v.len()).unwrap_or(u64::MAX)
}

impl Plan {
    /// The output tokens shown: the output minus the reasoning.
    fn visible(&self) -> u64 {
        self.completion_tokens
            .saturating_sub(self.responses.reasoning_tokens)
    }

    /// The answer stopped at `max_output_tokens`.
    fn incomplete(&self) -> bool {
        self.finish_reason == "length" && self.max_tokens.is_some()
    }

    /// A Responses usage of `output` tokens generated (at most the reported cap).
    fn responses_usage(&self, output: u64) -> Value {
        let output = output.min(self.reported_cap);
        json!({
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens},
            "output_tokens": output,
            "output_tokens_details": {
                "reasoning_tokens": self.responses.reasoning_tokens.min(output),
            },
            "total_tokens": self.prompt_tokens.saturating_add(output),
        })
    }

    fn message_id(&self) -> String {
        self.id.replacen("resp_", "msg_", 1)
    }

    fn function_call_id(&self) -> String {
        self.id.replacen("resp_", "fc_", 1)
    }

    /// The id of the message (or, with `tool_call`, the function call) item.
    fn item_id(&self) -> String {
        if self.fault == Fault::ToolCall {
            self.function_call_id()
        } else {
            self.message_id()
        }
    }

    /// Hosted call `i` as an output item.
    fn hosted_item(&self, i: usize, kind: &str, status: &str) -> Value {
        let seq = self.id.trim_start_matches("resp_mock_");
        json!({"type": format!("{kind}_call"), "id": format!("{kind}_mock_{seq}_{i}"), "status": status})
    }

    /// The function call's arguments for visible tokens `from..to`.
    fn responses_arguments(&self, from: u64, to: u64) -> String {
        tokens::arguments(from, to, self.visible())
    }

    /// The message (or function call) item, finished.
    fn final_item(&self) -> Value {
        let visible = self.visible();
        if self.fault == Fault::ToolCall {
            json!({
                "type": "function_call",
                "id": self.function_call_id(),
                "call_id": self.call_id,
                "name": "web_search",
                "arguments": self.responses_arguments(0, visible),
                "status": "completed",
            })
        } else {
            json!({
                "type": "message",
                "id": self.message_id(),
                "status": "completed",
                "role": "assistant",
                "content": [text_part(&tokens::words(0, visible))],
            })
        }
    }

    /// The whole output: the hosted calls, then the message (or function call).
    fn output(&self) -> Vec<Value> {
        let mut output: Vec<Value> = self
            .responses
            .hosted
            .iter()
            .enumerate()
            .map(|(i, kind)| self.hosted_item(i, kind, "completed"))
            .collect();
        output.push(self.final_item());
        output
    }

    /// The response object, with `status`, `output` and `usage`.
    fn response_object(&self, status: &str, output: Vec<Value>, usage: Value) -> Value {
        let incomplete_details = if status == "incomplete" {
            json!({"reason": "max_output_tokens"})
        } else {
            Value::Null
        };
        let mut r = json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "incomplete_details": incomplete_details,
            "model": self.model,
            "output": output,
            "usage": usage,
            "parallel_tool_calls": true,
            "tool_choice": "auto",
            "text": {"format": {"type": "text"}},
            "temperature": 1.0,
            "top_p": 1.0,
            "error": null,
            "metadata": {},
        });
        if let (Some(r), Some(echo)) = (r.as_object_mut(), self.responses.echo.as_object()) {
            r.extend(echo.clone());
        }
        r
    }

    /// The final status: `"incomplete"` when `max_output_tokens` cut the answer.
    fn final_status(&self) -> &'static str {
        if self.incomplete() {
            "incomplete"
        } else {
            "completed"
        }
    }

    /// The final usage (`null` with `no_usage`).
    fn final_usage(&self) -> Value {
        if self.fault == Fault::NoUsage {
            Value::Null
        } else {
            self.responses_usage(self.completion_tokens)
        }
    }
}

fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": []})
}

/// A whole (not streamed) answer.
pub(crate) async fn whole(mock: MockUpstream, plan: Plan) -> Response {
    let generation = plan.generation_time(plan.completion_tokens);
    if !generation.is_zero() {
        tokio::time::sleep(generation).await;
    }
    let body = plan.response_object(plan.final_status(), plan.output(), plan.final_usage());
    mock.count_prompt(&plan);
    count_hosted_all(&mock, &plan);
    mock.count_completion(&plan, plan.completion_tokens);
    mock.count_completed(&plan);
    (StatusCode::OK, Json(body)).into_response()
}

/// Counts every hosted call of the plan (produced at once).
pub(crate) fn count_hosted_all(mock: &MockUpstream, plan: &Plan) {
    for kind in &plan.responses.hosted {
        mock.count_hosted(plan, kind);
    }
}

/// Where a Responses stream is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Start,
    /// Hosted call `i`: its `output_item.added` and `output_item.done`.
    Hosted(usize),
    /// The message (or function call) item is added; the reasoning is generated first.
    ItemStart,
    Deltas,
    ItemDone,
    /// `response.completed` (or `response.incomplete`).
    Final,
    /// `content_after_usage`: one more delta after the final event.
    Trailing,
    /// `error_event`: `error`, then `response.failed`.
    Error,
    Abort,
    End,
}

struct Generator {
    mock: MockUpstream,
    plan: Plan,
    phase: Phase,
    /// The next event's `sequence_number`.
    sequence: u64,
    /// Visible tokens sent.
    next_token: u64,
    deltas: u64,
}

/// A streamed answer, generated and counted as it is polled.
pub(crate) fn stream(mock: MockUpstream, plan: Plan) -> Response {
    let g = Generator {
        mock,
        plan,
        phase: Phase::Start,
        sequence: 0,
        next_token: 0,
        deltas: 0,
    };
    let body = futures::stream::unfold(g, |mut g| async move {
        let item = g.next_item().await?;
        Some((item, g))
    });
    crate::stream::sse_response(Body::from_stream(body))
}

impl Generator {
    /// One event `kind` with `data` (an object), typed and numbered.
    fn event(&mut self, out: &mut String, kind: &str, mut data: Value) {
        if let Some(obj) = data.as_object_mut() {
            obj.insert("type".to_owned(), json!(kind));
            obj.insert("sequence_number".to_owned(), json!(self.sequence));
        }
        self.sequence = self.sequence.saturating_add(1);
        out.push_str(&format!("event: {kind}\ndata: {data}\n\n"));
    }

    /// The output index of the message (or function call) item.
    fn item_index(&self) -> usize {
        self.plan.responses.hosted.len()
    }

    async fn next_item(&mut self) -> Option<Result<Bytes, std::io::Error>> {
        let mut out = String::new();
        match self.phase {
            Phase::Start => {
                self.mock.count_prompt(&self.plan);
                let r = self
                    .plan
                    .response_object("in_progress", Vec::new(), Value::Null);
                self.event(&mut out, "response.created", json!({"response": r}));
                self.event(&mut out, "response.in_progress", json!({"response": r}));
                self.phase = if self.plan.responses.hosted.is_empty() {
                    Phase::ItemStart
                } else {
                    Phase::Hosted(0)
                };
            }
            Phase::Hosted(i) => {
                let kind = self
                    .plan
                    .responses
                    .hosted
                    .get(i)
                    .cloned()
                    .unwrap_or_default();
                let added = self.plan.hosted_item(i, &kind, "in_progress");
                let done = self.plan.hosted_item(i, &kind, "completed");
                self.event(
                    &mut out,
                    "response.output_item.added",
                    json!({"output_index": i, "item": added}),
                );
                self.event(
                    &mut out,
                    "response.output_item.done",
                    json!({"output_index": i, "item": done}),
                );
                self.mock.count_hosted(&self.plan, &kind);
                self.phase = if i + 1 < self.plan.responses.hosted.len() {
                    Phase::Hosted(i + 1)
                } else {
                    Phase::ItemStart
                };
            }
            Phase::ItemStart => self.item_start(&mut out).await,
            Phase::Deltas => self.delta(&mut out).await,
            Phase::ItemDone => self.item_done(&mut out),
            Phase::Final => {
                let plan = &self.plan;
                let status = plan.final_status();
                let r = plan.response_object(status, plan.output(), plan.final_usage());
                self.event(
                    &mut out,
                    &format!("response.{status}"),
                    json!({"response": r}),
                );
                self.mock.count_completed(&self.plan);
                self.phase = if self.plan.fault == Fault::ContentAfterUsage {
                    Phase::Trailing
                } else {
                    Phase::End
                };
            }
            Phase::Trailing => {
                let (from, to) = (self.next_token, self.next_token.saturating_add(1));
                let data = json!({"item_id": self.plan.item_id(), "output_index": self.item_index(),
                    "content_index": 0, "delta": tokens::words(from, to)});
                self.event(&mut out, "response.output_text.delta", data);
                self.mock.count_completion(&self.plan, 1);
                self.next_token = to;
                self.phase = Phase::End;
            }
            Phase::Error => {
                let data =
                    json!({"code": "server_error", "message": "mock error event", "param": null});
                self.event(&mut out, "error", data);
                let plan = &self.plan;
                let generated = plan
                    .responses
                    .reasoning_tokens
                    .saturating_add(self.next_token);
                let mut r =
                    plan.response_object("failed", Vec::new(), plan.responses_usage(generated));
                r["error"] = json!({"code": "server_error", "message": "mock error event"});
                self.event(&mut out, "response.failed", json!({"response": r}));
                self.phase = Phase::End;
            }
            Phase::Abort => {
                self.phase = Phase::End;
                // Let the HTTP layer flush what was sent so far before the abort.
                tokio::task::yield_now().await;
                return Some(Err(std::io::Error::new(
                    std::io::ErrorKind::ConnectionAborted,
                    "mock upstream: stream dropped on purpose (fault drop_mid_stream)",
                )));
            }
            Phase::End => return None,
        }
        Some(Ok(Bytes::from(out)))
    }

    /// The reasoning (paced, counted), then the message (or function call) item is added.
    async fn item_start(&mut self, out: &mut String) {
        let reasoning = self.plan.responses.reasoning_tokens;
        let pause = self.plan.generation_time(reasoning);
        if !pause.is_zero() {
            tokio::time::sleep(pause).await;
        }
        self.mock.count_completion(&self.plan, reasoning);
        let (index, id) = (self.item_index(), self.plan.item_id());
        if self.plan.fault == Fault::ToolCall {
            let item = json!({"type": "function_call", "id": id, "call_id": self.plan.call_id,
                "name": "web_search", "arguments": "", "status": "in_progress"});
            self.event(
                out,
                "response.output_item.added",
                json!({"output_index": index, "item": item}),
            );
        } else {
            let item = json!({"type": "message", "id": id, "status": "in_progress",
                "role": "assistant", "content": []});
            self.event(
                out,
                "response.output_item.added",
                json!({"output_index": index, "item": item}),
            );
            self.event(
                out,
                "response.content_part.added",
                json!({"item_id": id, "output_index": index, "content_index": 0,
                    "part": text_part("")}),
            );
        }
        self.phase = if self.plan.visible() == 0 {
            self.after_deltas(true)
        } else {
            Phase::Deltas
        };
    }

    /// The next delta: up to `chunk_tokens` visible tokens, paced, counted as sent.
    async fn delta(&mut self, out: &mut String) {
        let total = self.plan.visible();
        let from = self.next_token;
        let to = from.saturating_add(self.plan.chunk_tokens).min(total);
        let pause = self.plan.generation_time(to - from);
        if !pause.is_zero() {
            tokio::time::sleep(pause).await;
        }
        let (index, id) = (self.item_index(), self.plan.item_id());
        if self.plan.fault == Fault::ToolCall {
            let delta = self.plan.responses_arguments(from, to);
            self.event(
                out,
                "response.function_call_arguments.delta",
                json!({"item_id": id, "output_index": index, "delta": delta}),
            );
        } else {
            let delta = tokens::words(from, to);
            self.event(
                out,
                "response.output_text.delta",
                json!({"item_id": id, "output_index": index, "content_index": 0, "delta": delta}),
            );
        }
        self.next_token = to;
        self.deltas = self.deltas.saturating_add(1);
        self.mock.count_completion(&self.plan, to - from);
        self.phase = self.after_deltas(to >= total);
    }

    /// What follows a delta (`done`: it was the last one).
    fn after_deltas(&self, done: bool) -> Phase {
        let cut = done || self.deltas >= DELTAS_BEFORE_DROP;
        match self.plan.fault {
            Fault::DropMidStream if cut => Phase::Abort,
            Fault::CleanCut if cut => Phase::End,
            Fault::ErrorEvent if done => Phase::Error,
            _ if done => Phase::ItemDone,
            _ => Phase::Deltas,
        }
    }

    /// The item's closing events.
    fn item_done(&mut self, out: &mut String) {
        let (index, id) = (self.item_index(), self.plan.item_id());
        let item = self.plan.final_item();
        if self.plan.fault == Fault::ToolCall {
            let arguments = item["arguments"].clone();
            self.event(
                out,
                "response.function_call_arguments.done",
                json!({"item_id": id, "output_index": index, "arguments": arguments}),
            );
        } else {
            let text = tokens::words(0, self.plan.visible());
            self.event(
                out,
                "response.output_text.done",
                json!({"item_id": id, "output_index": index, "content_index": 0, "text": text}),
            );
            self.event(
                out,
                "response.content_part.done",
                json!({"item_id": id, "output_index": index, "content_index": 0,
                    "part": text_part(&text)}),
            );
        }
        self.event(
            out,
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        );
        self.phase = Phase::Final;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn prompt_tokens_of_each_part() {
        assert_eq!(responses_prompt_tokens_of(&json!({"input": []})), 3);
        // "hello" 5 bytes -> 2, +4; instructions "be brief" 8 -> 2, +4.
        let body = json!({"input": "hello", "instructions": "be brief"});
        assert_eq!(responses_prompt_tokens_of(&body), 3 + 6 + 6);
        let body = json!({"input": [
            {"role": "user", "content": "hello"},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "abc"}, {"type": "input_text", "text": "defgh"}]},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{\"q\":\"rust\"}"},
            {"type": "function_call_output", "call_id": "c", "output": "result"},
            {"type": "item_reference", "id": "x"}
        ]});
        assert_eq!(
            responses_prompt_tokens_of(&body),
            3 + (2 + 4) + (2 + 4) + (3 + 4) + (2 + 4) + 4
        );
        let tool = json!({"type": "function", "name": "f", "parameters": {}});
        let bytes = serde_json::to_string(&tool).map_or(0, |s| s.len() as u64);
        let body = json!({"input": [], "tools": [tool, {"type": "web_search"}]});
        assert_eq!(responses_prompt_tokens_of(&body), 3 + bytes.div_ceil(4));
    }

    #[test]
    fn input_is_required() {
        assert!(prompt_tokens(&json!({"model": "m"})).is_err());
        assert!(prompt_tokens(&json!({"input": 5})).is_err());
        assert!(prompt_tokens(&json!({"input": "x", "instructions": 1})).is_err());
        assert!(prompt_tokens(&json!({"input": "x"})).is_ok());
    }

    #[test]
    fn hosted_calls_are_per_tool_capped_then_extra() {
        let mut h = HeaderMap::new();
        h.insert(HOSTED_TOOL_CALLS_HEADER, HeaderValue::from_static("2"));
        h.insert(
            EXTRA_HOSTED_TOOL_CALLS_HEADER,
            HeaderValue::from_static("1"),
        );
        let tools = json!([{"type": "web_search_preview_2025_03_11"}, {"type": "function", "name": "f"},
            {"type": "file_search"}, {"type": "custom", "name": "c"}]);
        let e = extras(&h, &json!({"tools": tools, "max_tool_calls": 3}), 4).expect("extras");
        assert_eq!(
            e.hosted,
            ["web_search", "web_search", "file_search", "web_search"]
        );
        let e = extras(&HeaderMap::new(), &json!({"tools": tools}), 4).expect("extras");
        assert_eq!(e.hosted, ["web_search", "file_search"]);
        assert_eq!(e.echo["store"], true);
        assert!(extras(&HeaderMap::new(), &json!({"tools": {}}), 4).is_err());
    }
}
