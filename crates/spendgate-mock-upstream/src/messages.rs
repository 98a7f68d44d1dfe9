//! `POST /v1/messages`: Anthropic's Messages shape (see the crate docs' Messages section).

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::tokens::{self, PER_MESSAGE_TOKENS};
use crate::{aborted_response, Fault, MockUpstream, Plan, MAX_WAIT};

/// How many deltas `drop_mid_stream` and `clean_cut` send before they end.
const DELTAS_BEFORE_DROP: u64 = 2;

/// [`crate::prompt_tokens_of`] the body, plus its `system` (a string, or text blocks) as one
/// more message.
pub(crate) fn prompt_tokens(body: &Value) -> u64 {
    let base = crate::prompt_tokens_of(body);
    let system: u64 = match body.get("system") {
        Some(Value::String(s)) => s.len() as u64,
        Some(Value::Array(blocks)) => blocks
            .iter()
            .filter_map(|b| b.get("text").and_then(Value::as_str))
            .map(|t| t.len() as u64)
            .sum(),
        _ => return base,
    };
    base.saturating_add(system.div_ceil(4))
        .saturating_add(PER_MESSAGE_TOKENS)
}

/// An error in Anthropic's shape.
pub(crate) fn error_response(status: StatusCode, kind: &str, message: &str) -> Response {
    let body = json!({"type": "error", "error": {"type": kind, "message": message}});
    (status, Json(body)).into_response()
}

impl Plan {
    /// The usage of `output` tokens, each class apart (at most the reported cap of output).
    fn messages_usage(&self, output: u64) -> Value {
        let input = self
            .prompt_tokens
            .saturating_sub(self.cached_tokens)
            .saturating_sub(self.cache_write_tokens);
        json!({
            "input_tokens": input,
            "cache_creation_input_tokens": self.cache_write_tokens,
            "cache_read_input_tokens": self.cached_tokens,
            "output_tokens": output.min(self.reported_cap),
        })
    }

    fn stop_reason(&self) -> &'static str {
        match self.finish_reason {
            "length" => "max_tokens",
            "tool_calls" => "tool_use",
            _ => "end_turn",
        }
    }

    /// The tool use's input text for tokens `from..to` (see [`Plan::arguments_fragment`]).
    fn block(&self, from: u64, to: u64) -> Value {
        if self.fault == Fault::ToolCall {
            json!({"type": "input_json_delta", "partial_json": self.arguments_fragment(from, to)})
        } else {
            json!({"type": "text_delta", "text": tokens::words(from, to)})
        }
    }
}

/// The answer to a planned Messages request, after its latency.
pub(crate) async fn answer(mock: MockUpstream, plan: Plan) -> Response {
    match plan.fault {
        Fault::Http429 => {
            let mut r = error_response(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "mock upstream: rate limited (fault http_429)",
            );
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            r
        }
        Fault::Http500 => error_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            "api_error",
            "mock upstream: internal error (fault http_500)",
        ),
        Fault::Http307 => {
            let mut r = error_response(
                StatusCode::TEMPORARY_REDIRECT,
                "invalid_request_error",
                "mock upstream: moved (fault http_307)",
            );
            r.headers_mut()
                .insert(header::LOCATION, HeaderValue::from_static("/v1/models"));
            r
        }
        Fault::Http504 => {
            mock.count_prompt(&plan);
            mock.count_completion(&plan, plan.completion_tokens);
            error_response(
                StatusCode::GATEWAY_TIMEOUT,
                "timeout_error",
                "mock upstream: gateway timeout after the work was done (fault http_504)",
            )
        }
        Fault::Hang => {
            mock.count_prompt(&plan);
            tokio::time::sleep(MAX_WAIT).await;
            aborted_response()
        }
        Fault::DropMidStream if !plan.stream => {
            mock.count_prompt(&plan);
            aborted_response()
        }
        _ if plan.stream => stream(mock, plan),
        _ => whole(mock, plan).await,
    }
}

/// A whole answer.
async fn whole(mock: MockUpstream, plan: Plan) -> Response {
    let generation = plan.generation_time(plan.completion_tokens);
    if !generation.is_zero() {
        tokio::time::sleep(generation).await;
    }
    let content = if plan.fault == Fault::ToolCall {
        let input: Value =
            serde_json::from_str(&plan.arguments_fragment(0, plan.completion_tokens))
                .unwrap_or(Value::Null);
        json!([{"type": "tool_use", "id": plan.call_id, "name": "web_search", "input": input}])
    } else {
        json!([{"type": "text", "text": tokens::words(0, plan.completion_tokens)}])
    };
    let mut body = json!({
        "id": plan.id,
        "type": "message",
        "role": "assistant",
        "model": plan.model,
        "content": content,
        "stop_reason": plan.stop_reason(),
        "stop_sequence": null,
    });
    if plan.fault != Fault::NoUsage {
        body["usage"] = plan.messages_usage(plan.completion_tokens);
    }
    mock.count_prompt(&plan);
    mock.count_completion(&plan, plan.completion_tokens);
    mock.count_completed(&plan);
    (StatusCode::OK, Json(body)).into_response()
}

fn event(kind: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {kind}\ndata: {data}\n\n"))
}

/// Where a Messages stream is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Start,
    Deltas,
    BlockStop,
    MessageDelta,
    /// `content_after_usage`: one more delta after `message_delta`.
    Trailing,
    Stop,
    Abort,
    End,
}

struct Generator {
    mock: MockUpstream,
    plan: Plan,
    phase: Phase,
    next_token: u64,
    deltas: u64,
}

/// A streamed answer, generated and counted as it is polled.
fn stream(mock: MockUpstream, plan: Plan) -> Response {
    let g = Generator {
        mock,
        plan,
        phase: Phase::Start,
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
    async fn next_item(&mut self) -> Option<Result<Bytes, std::io::Error>> {
        let plan = &self.plan;
        let usage = plan.fault != Fault::NoUsage;
        match self.phase {
            Phase::Start => {
                self.mock.count_prompt(plan);
                let mut message = json!({
                    "id": plan.id, "type": "message", "role": "assistant", "model": plan.model,
                    "content": [], "stop_reason": null, "stop_sequence": null,
                });
                if usage {
                    message["usage"] = plan.messages_usage(1.min(plan.completion_tokens));
                }
                let block = if plan.fault == Fault::ToolCall {
                    json!({"type": "tool_use", "id": plan.call_id, "name": "web_search", "input": {}})
                } else {
                    json!({"type": "text", "text": ""})
                };
                let mut out = event(
                    "message_start",
                    &json!({"type": "message_start", "message": message}),
                )
                .to_vec();
                out.extend_from_slice(&event(
                    "content_block_start",
                    &json!({"type": "content_block_start", "index": 0, "content_block": block}),
                ));
                out.extend_from_slice(&event("ping", &json!({"type": "ping"})));
                self.phase = if plan.completion_tokens == 0 {
                    Phase::BlockStop
                } else {
                    Phase::Deltas
                };
                Some(Ok(Bytes::from(out)))
            }
            Phase::Deltas => Some(Ok(self.delta().await)),
            Phase::BlockStop => {
                self.phase = if plan.fault == Fault::ErrorEvent {
                    Phase::Stop
                } else {
                    Phase::MessageDelta
                };
                if plan.fault == Fault::ErrorEvent {
                    return Some(Ok(event(
                        "error",
                        &json!({"type": "error", "error": {"type": "overloaded_error",
                            "message": "mock upstream: failed mid-stream (fault error_event)"}}),
                    )));
                }
                Some(Ok(event(
                    "content_block_stop",
                    &json!({"type": "content_block_stop", "index": 0}),
                )))
            }
            Phase::MessageDelta => {
                self.phase = match plan.fault {
                    Fault::ContentAfterUsage => Phase::Trailing,
                    Fault::NoDone => {
                        self.mock.count_completed(plan);
                        Phase::End
                    }
                    _ => Phase::Stop,
                };
                let mut data = json!({"type": "message_delta",
                    "delta": {"stop_reason": plan.stop_reason(), "stop_sequence": null}});
                if usage {
                    data["usage"] =
                        json!({"output_tokens": plan.completion_tokens.min(plan.reported_cap)});
                }
                Some(Ok(event("message_delta", &data)))
            }
            Phase::Trailing => {
                self.phase = Phase::Stop;
                let (from, to) = (self.next_token, self.next_token.saturating_add(1));
                self.mock.count_completion(plan, 1);
                self.next_token = to;
                let data = json!({"type": "content_block_delta", "index": 0,
                    "delta": {"type": "text_delta", "text": tokens::words(from, to)}});
                Some(Ok(event("content_block_delta", &data)))
            }
            Phase::Stop => {
                self.phase = Phase::End;
                if plan.fault != Fault::ErrorEvent {
                    self.mock.count_completed(plan);
                }
                Some(Ok(event("message_stop", &json!({"type": "message_stop"}))))
            }
            Phase::Abort => {
                self.phase = Phase::End;
                tokio::task::yield_now().await;
                Some(Err(std::io::Error::new(
                    std::io::ErrorKind::ConnectionAborted,
                    "mock upstream: stream dropped on purpose (fault drop_mid_stream)",
                )))
            }
            Phase::End => None,
        }
    }

    /// The next `content_block_delta`: up to `chunk_tokens` tokens, paced, counted as sent.
    async fn delta(&mut self) -> Bytes {
        let plan = &self.plan;
        let total = plan.completion_tokens;
        let from = self.next_token;
        let to = from.saturating_add(plan.chunk_tokens).min(total);
        let pause = plan.generation_time(to - from);
        if !pause.is_zero() {
            tokio::time::sleep(pause).await;
        }
        let data =
            json!({"type": "content_block_delta", "index": 0, "delta": plan.block(from, to)});
        self.next_token = to;
        self.deltas = self.deltas.saturating_add(1);
        self.mock.count_completion(plan, to - from);
        let done = to >= total;
        let cut = done || self.deltas >= DELTAS_BEFORE_DROP;
        self.phase = match plan.fault {
            Fault::DropMidStream if cut => Phase::Abort,
            Fault::CleanCut if cut => Phase::End,
            _ if done => Phase::BlockStop,
            _ => Phase::Deltas,
        };
        event("content_block_delta", &data)
    }
}
