//! The streamed (Server-Sent Events) answer, generated lazily chunk by chunk.
//!
//! Each chunk is built and counted only when the HTTP layer polls for it, so the stats count
//! exactly what was handed to the connection: if the client goes away, the body is dropped and
//! nothing after that is generated or counted.

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use serde_json::{json, Value};

use crate::{tokens, Fault, MockUpstream, Plan};

/// Where a stream is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Content,
    Finish,
    Usage,
    /// `content_after_usage`: one more content chunk after the usage.
    Trailing,
    /// `error_event`: an error event with the usage so far, in place of the finish chunk.
    Error,
    Done,
    /// After `[DONE]`: the body stays open `Plan::linger`, then ends.
    Linger,
    Abort,
    End,
}

struct Generator {
    mock: MockUpstream,
    plan: Plan,
    phase: Phase,
    next_token: u64,
    chunks_sent: u64,
}

/// How many content chunks `drop_mid_stream` and `clean_cut` send before they end.
const CHUNKS_BEFORE_DROP: u64 = 2;

/// Build the streaming response for `plan`.
pub(crate) fn response(mock: MockUpstream, plan: Plan) -> Response {
    let generator = Generator {
        mock,
        plan,
        phase: Phase::Content,
        next_token: 0,
        chunks_sent: 0,
    };
    let stream = futures::stream::unfold(generator, |mut g| async move {
        let item = g.next_item().await?;
        Some((item, g))
    });
    sse_response(Body::from_stream(stream))
}

/// A 200 answer of Server-Sent Events with `body`, not to be cached or buffered on its way.
pub(crate) fn sse_response(body: Body) -> Response {
    let mut response = Response::new(body);
    *response.status_mut() = StatusCode::OK;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    response
}

fn sse(data: &Value) -> Bytes {
    Bytes::from(format!("data: {data}\n\n"))
}

impl Generator {
    /// The next piece of the body, `None` at the end.
    async fn next_item(&mut self) -> Option<Result<Bytes, std::io::Error>> {
        match self.phase {
            Phase::Content => Some(Ok(self.content_chunk().await)),
            Phase::Finish => {
                self.phase = if self.plan.include_usage && self.plan.fault != Fault::NoUsage {
                    Phase::Usage
                } else {
                    self.after_usage()
                };
                let finish_reason = self.plan.finish_reason;
                Some(Ok(self.chunk(json!({}), Some(finish_reason))))
            }
            Phase::Usage => {
                self.phase = if self.plan.fault == Fault::ContentAfterUsage {
                    Phase::Trailing
                } else {
                    self.after_usage()
                };
                let plan = &self.plan;
                Some(Ok(sse(&plan.event(json!({
                    "choices": [],
                    "usage": plan.usage(),
                })))))
            }
            Phase::Trailing => {
                self.phase = Phase::Done;
                let (from, to) = (self.next_token, self.next_token.saturating_add(1));
                self.mock.count_completion(&self.plan, 1);
                self.next_token = to;
                Some(Ok(
                    self.chunk(json!({"content": tokens::words(from, to)}), None)
                ))
            }
            Phase::Error => {
                self.phase = Phase::Done;
                let plan = &self.plan;
                Some(Ok(sse(&plan.event(json!({
                    "error": {
                        "message": "mock upstream: failed mid-stream (fault error_event)",
                        "type": "server_error",
                        "param": null,
                        "code": null,
                    },
                    "usage": plan.usage_with(self.next_token, plan.cached_tokens),
                })))))
            }
            Phase::Done if self.plan.fault == Fault::ErrorEvent => {
                self.phase = Phase::End;
                Some(Ok(Bytes::from_static(b"data: [DONE]\n\n")))
            }
            Phase::Done => {
                self.phase = Phase::Linger;
                self.mock.count_completed(&self.plan);
                Some(Ok(Bytes::from_static(b"data: [DONE]\n\n")))
            }
            Phase::Linger => {
                self.phase = Phase::End;
                tokio::time::sleep(self.plan.linger).await;
                None
            }
            Phase::Abort => {
                self.phase = Phase::End;
                // Let the HTTP layer flush what was sent so far (it flushes when the body is
                // not ready), so the client does receive the chunks before the abort.
                tokio::task::yield_now().await;
                Some(Err(std::io::Error::new(
                    std::io::ErrorKind::ConnectionAborted,
                    "mock upstream: stream dropped on purpose (fault drop_mid_stream)",
                )))
            }
            Phase::End => None,
        }
    }

    /// The next content chunk: up to `chunk_tokens` tokens, paced, counted as it is emitted.
    async fn content_chunk(&mut self) -> Bytes {
        let total = self.plan.completion_tokens;
        let from = self.next_token;
        let to = from.saturating_add(self.plan.chunk_tokens).min(total);
        let pause = self.plan.generation_time(to - from);
        if !pause.is_zero() {
            tokio::time::sleep(pause).await;
        }
        let first = self.chunks_sent == 0;
        let delta = if self.plan.fault == Fault::ToolCall {
            let arguments = self.plan.arguments_fragment(from, to);
            if first {
                json!({
                    "role": "assistant",
                    "content": null,
                    "tool_calls": [{
                        "index": 0,
                        "id": self.plan.call_id,
                        "type": "function",
                        "function": {"name": "web_search", "arguments": arguments},
                    }],
                })
            } else {
                json!({"tool_calls": [{"index": 0, "function": {"arguments": arguments}}]})
            }
        } else if first {
            json!({"role": "assistant", "content": tokens::words(from, to)})
        } else {
            json!({"content": tokens::words(from, to)})
        };
        self.next_token = to;
        let bytes = self.chunk(delta, None);
        if first {
            self.mock.count_prompt(&self.plan);
        }
        self.mock.count_completion(&self.plan, to - from);
        self.chunks_sent = self.chunks_sent.saturating_add(1);
        let content_done = to >= total;
        let cut = content_done || self.chunks_sent >= CHUNKS_BEFORE_DROP;
        if self.plan.fault == Fault::DropMidStream && cut {
            self.phase = Phase::Abort;
        } else if self.plan.fault == Fault::CleanCut && cut {
            self.phase = Phase::End;
        } else if content_done && self.plan.fault == Fault::ErrorEvent {
            self.phase = Phase::Error;
        } else if content_done {
            self.phase = Phase::Finish;
        }
        bytes
    }

    /// What follows the usage chunk (or the finish chunk, when there is none).
    fn after_usage(&mut self) -> Phase {
        if self.plan.fault == Fault::NoDone {
            self.mock.count_completed(&self.plan);
            Phase::End
        } else {
            Phase::Done
        }
    }

    fn chunk(&self, delta: Value, finish_reason: Option<&str>) -> Bytes {
        let plan = &self.plan;
        let mut chunk = plan.event(json!({
            "choices": [{
                "index": 0,
                "delta": delta,
                "logprobs": null,
                "finish_reason": finish_reason,
            }],
        }));
        if let Some(obj) = chunk.as_object_mut() {
            // OpenAI sends `"usage": null` on every chunk but the last when usage was asked for.
            if plan.include_usage && plan.fault != Fault::NoUsage {
                obj.insert("usage".to_owned(), Value::Null);
            }
            // The running usage (`x-mock-running-usage`): `next_token` counts the tokens sent
            // up to this chunk's end.
            if let Some(cached) = plan.running_cached {
                obj.insert("usage".to_owned(), plan.usage_with(self.next_token, cached));
            }
            if plan.stamp {
                let sent = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
                obj.insert(crate::STAMP_FIELD.to_owned(), json!(sent));
            }
        }
        sse(&chunk)
    }
}
